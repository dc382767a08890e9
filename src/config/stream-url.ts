import { ConfigError } from '../errors.js';

/**
 * The URL of a RabbitMQ stream endpoint, in the form RabbitMQ's own stream clients take:
 * `rabbitmq-stream://user:pass@host:5552/vhost`, or `rabbitmq-stream+tls://` for TLS.
 *
 * User, password and vhost are percent-decoded. The port defaults to 5552 (5551 with TLS, the
 * stream plugin's default TLS listener). The vhost is the path after its first '/': an empty path
 * or '/' alone is the default vhost '/', and a vhost with a '/' in it is written `%2F`. No user
 * info means guest/guest, as every RabbitMQ client defaults. A password never appears in the text
 * of an error from here.
 */
export interface StreamEndpoint {
  host: string;
  port: number;
  vhost: string;
  username: string;
  password: string;
  tls: boolean;
}

const STREAM_PORT = 5552;
const STREAM_TLS_PORT = 5551;

const SCHEMES: Record<string, boolean> = { 'rabbitmq-stream:': false, 'rabbitmq-stream+tls:': true };

/** A URL with its password (if any) masked, for messages and logs. */
export function redactStreamUrl(url: string): string {
  const schemeEnd = url.indexOf('://');
  const from = schemeEnd >= 0 ? schemeEnd + 3 : 0;
  const at = url.lastIndexOf('@');
  if (at < from) return url;
  const colon = url.indexOf(':', from);
  if (colon < 0 || colon > at) return url;
  return `${url.slice(0, colon + 1)}***${url.slice(at)}`;
}

function decode(text: string, what: string, url: string): string {
  try {
    return decodeURIComponent(text);
  } catch {
    throw new ConfigError(`stream URL ${redactStreamUrl(url)}: its ${what} is not valid percent-encoding`);
  }
}

export function parseStreamUrl(url: string): StreamEndpoint {
  const shown = redactStreamUrl(url);
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    // Not the TypeError itself: Node puts the whole input (password and all) on it.
    throw new ConfigError(
      `stream URL ${shown} is not a URL; expected rabbitmq-stream://user:pass@host:5552/vhost`,
    );
  }
  const tls = SCHEMES[parsed.protocol];
  if (tls === undefined) {
    throw new ConfigError(
      `stream URL ${shown}: the scheme must be rabbitmq-stream:// or rabbitmq-stream+tls://`,
    );
  }
  const host = parsed.hostname.startsWith('[') ? parsed.hostname.slice(1, -1) : parsed.hostname;
  if (host === '') throw new ConfigError(`stream URL ${shown} has no host`);
  if (parsed.search !== '' || parsed.hash !== '') {
    throw new ConfigError(`stream URL ${shown}: query parameters and fragments are not supported`);
  }
  const port = parsed.port === '' ? (tls ? STREAM_TLS_PORT : STREAM_PORT) : Number(parsed.port);
  const path = parsed.pathname;
  const rawVhost = path.startsWith('/') ? path.slice(1) : path;
  if (rawVhost.includes('/')) {
    throw new ConfigError(`stream URL ${shown}: a vhost with a '/' in it is written %2F`);
  }
  const vhost = rawVhost === '' ? '/' : decode(rawVhost, 'vhost', url);
  const hasUser = parsed.username !== '' || parsed.password !== '';
  return {
    host,
    port,
    vhost,
    username: hasUser ? decode(parsed.username, 'user name', url) : 'guest',
    password: hasUser ? decode(parsed.password, 'password', url) : 'guest',
    tls,
  };
}

/**
 * Whether a URL is meant for the stream protocol: its scheme, read as text, is rabbitmq-stream or
 * rabbitmq-stream+<anything> (a misspelt +tls is then refused by parseStreamUrl, naming both forms).
 */
export function isStreamUrl(url: string): boolean {
  return /^\s*rabbitmq-stream(\+[a-z0-9.-]*)?:/i.test(url);
}

/** Where a stream source starts reading (the stream protocol's offset specification). */
export type StreamStart = 'first' | 'last' | 'next' | { offset: bigint } | { timestamp: bigint };
