/** Masks the password in a URL so it can be printed or logged. Never throws. */
export function redactUrl(url: string): string {
  const parts = parse(url);
  if (parts?.password) {
    parts.password = '***';
    return parts.toString();
  }
  // No password parsed, yet there may be one: typed without its scheme ("user:" reads as one),
  // unencoded so that it reads as a port and a path (amqp://bob:123/x@host), or not a URL at all.
  const found = passwordSpan(url, parts !== undefined);
  return found ? `${url.slice(0, found.start)}***${url.slice(found.end)}` : url;
}

function parse(url: string): URL | undefined {
  try {
    return new URL(url);
  } catch {
    return undefined;
  }
}

function decoded(text: string): string {
  try {
    return decodeURIComponent(text);
  } catch {
    return text;
  }
}

/**
 * The text rule: from the first ':' of the user info to the last '@', where URL parsers split. For
 * a URL that parsed without a password, only where that span could be user info at all (no IPv6
 * host, query or fragment in it), so that `amqp://[::1]:5672/x@y` is left as it is.
 */
function passwordSpan(url: string, parsed: boolean): { start: number; end: number } | undefined {
  const schemeEnd = url.indexOf('://');
  const from = schemeEnd >= 0 ? schemeEnd + 3 : 0;
  const at = url.lastIndexOf('@');
  const colon = url.indexOf(':', from);
  if (at < from || colon < 0 || colon > at) return undefined;
  if (parsed && /[[?#]/.test(url.slice(from, at))) return undefined;
  return { start: colon + 1, end: at };
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
  const parts = parse(url);
  if (parts?.password) return decoded(parts.password);
  const found = passwordSpan(url, parts !== undefined);
  return found ? decoded(url.slice(found.start, found.end)) : '';
}
