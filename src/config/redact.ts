/** Masks the password in a URL so it can be printed or logged. Never throws. */
export function redactUrl(url: string): string {
  try {
    const parsed = new URL(url);
    if (parsed.password) {
      parsed.password = '***';
      return parsed.toString();
    }
    if (url.includes('://')) return url;
    // Parsed without "//": typed without its scheme, "user:" reads as one. Use the text rule.
  } catch {
    // Not a URL we can parse: use the text rule.
  }
  // Mask between the first ':' of the user info and the last '@', where URL parsers split.
  const schemeEnd = url.indexOf('://');
  const prefix = schemeEnd >= 0 ? url.slice(0, schemeEnd + 3) : '';
  const rest = url.slice(prefix.length);
  const at = rest.lastIndexOf('@');
  const colon = rest.indexOf(':');
  if (at < 0 || colon < 0 || colon > at) return url;
  return `${prefix}${rest.slice(0, colon)}:***${rest.slice(at)}`;
}

/** Removes every occurrence of the given secrets from a text (for errors that echo a URL). */
export function redactSecrets(text: string, secrets: readonly string[]): string {
  let out = text;
  for (const secret of secrets) {
    if (secret.length > 0) out = out.split(secret).join('***');
  }
  return out;
}

/** The password of a URL, decoded, or '' — used to scrub it from third-party error texts. */
export function passwordOf(url: string): string {
  try {
    return decodeURIComponent(new URL(url).password);
  } catch {
    return '';
  }
}
