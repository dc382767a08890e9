/**
 * Masks the secrets in a URL so it can be printed or logged: the password of its user info, and
 * query parameters that carry one (ioredis takes `?password=`, and this bridge's Sentinel URLs
 * `?sentinelPassword=`). Never throws.
 */
export function redactUrl(url: string): string {
  const parts = parse(url);
  let out = url;
  if (parts?.password) {
    parts.password = '***';
    out = parts.toString();
  } else {
    // No password parsed, yet there may be one: typed without its scheme ("user:" reads as one),
    // unencoded so that it reads as a port and a path, query or fragment (amqp://bob:123/x@host,
    // and with an @ in the user name amqp://bob@corp:123/x@host, which parses as user "bob"), or
    // in a form that is not a WHATWG URL.
    const found = passwordSpan(url, parts !== undefined);
    if (found) out = `${url.slice(0, found.start)}***${url.slice(found.end)}`;
  }
  return out.replace(SECRET_PARAM, (_match, lead: string) => `${lead}***`);
}

/** A query parameter whose name says it holds a secret, up to its end; the name is kept. */
const SECRET_PARAM = /([?&;][^=&#?;]*(?:pass|secret|token)[^=&#?;]*=)[^&#;]*/gi;

function parse(url: string): URL | undefined {
  try {
    return new URL(url);
  } catch {
    return undefined;
  }
}

function decoded(text: string, plusIsSpace = false): string {
  try {
    // In a query a + is a space (as ioredis reads it); in user info it is a +.
    return decodeURIComponent(plusIsSpace ? text.replace(/\+/g, ' ') : text);
  } catch {
    return text;
  }
}

/**
 * The text rule: from the first ':' of the user info to the last '@', where URL parsers split.
 * Whatever lies between is taken for a password, also when a parser read part of it as a path or
 * a query: a password must never be printed, and an '@' in a path or query is rare enough that
 * masking it too costs nothing. Only an IPv6 host (`amqp://[::1]:5672/x@y`) is left as it is.
 */
function passwordSpan(url: string, parsed: boolean): { start: number; end: number } | undefined {
  const schemeEnd = url.indexOf('://');
  const from = schemeEnd >= 0 ? schemeEnd + 3 : 0;
  const at = url.lastIndexOf('@');
  const colon = url.indexOf(':', from);
  if (at < from || colon < 0 || colon > at) return undefined;
  if (parsed && url.slice(from, at).includes('[')) return undefined;
  return { start: colon + 1, end: at };
}

/** Removes every occurrence of the given secrets from a text (for errors that echo a URL). */
export function redactSecrets(text: string, secrets: readonly string[]): string {
  let out = text;
  // Longest first, so that a secret containing another is removed whole.
  for (const secret of [...secrets].sort((a, b) => b.length - a.length)) {
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

/**
 * Every secret a URL holds, as typed and decoded: its password and the values of its secret query
 * parameters. For scrubbing texts of other libraries, which may echo any of them.
 */
export function secretsOf(url: string): string[] {
  const found = new Set<string>();
  const password = passwordOf(url);
  if (password) found.add(password);
  const parts = parse(url);
  if (parts?.password) found.add(parts.password);
  for (const match of url.matchAll(SECRET_PARAM)) {
    const raw = match[0].slice(match[1]?.length ?? 0);
    if (raw) {
      found.add(raw);
      found.add(decoded(raw, true));
    }
  }
  return [...found];
}

/** Whether a URL that parsed with no password still holds one (an unencoded / ? # or @). */
export function hasHiddenPassword(url: string): boolean {
  const parts = parse(url);
  return parts !== undefined && !parts.password && passwordOf(url) !== '';
}
