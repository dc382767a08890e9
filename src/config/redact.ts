/** Masks the password in a URL so it can be printed or logged. Never throws. */
export function redactUrl(url: string): string {
  try {
    const parsed = new URL(url);
    if (parsed.password) parsed.password = '***';
    return parsed.toString();
  } catch {
    // Not a URL we can parse: mask anything between "//user:" and "@".
    return url.replace(/(\/\/[^:/@]*:)[^@]*@/, '$1***@');
  }
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
