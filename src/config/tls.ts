import { X509Certificate } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { isIP } from 'node:net';
import { type ConnectionOptions, createSecureContext } from 'node:tls';
import { ConfigError } from '../errors.js';

/**
 * PEM files for one server's TLS connection: the CA to trust (instead of the system's CAs) and a
 * client certificate with its key, for servers that ask for one. Paths: the files are read when a
 * connection is opened (a broker reconnect reads them again).
 */
export interface TlsFiles {
  ca?: string;
  cert?: string;
  key?: string;
}

export interface TlsSettings {
  source: TlsFiles;
  target: TlsFiles;
  redis: TlsFiles;
}

/** Which server a set of files is for; it names the flags in messages (--source-ca, ...). */
export type TlsSide = keyof TlsSettings;

/** The TLS options as the CLI (or a config file) collects them. */
export interface TlsRawOptions {
  sourceCa?: string;
  sourceCert?: string;
  sourceKey?: string;
  targetCa?: string;
  targetCert?: string;
  targetKey?: string;
  redisCa?: string;
  redisCert?: string;
  redisKey?: string;
}

const FILE_KINDS = ['ca', 'cert', 'key'] as const;
type FileKind = (typeof FILE_KINDS)[number];

const TLS_SCHEME: Record<TlsSide, string> = { source: 'amqps', target: 'amqps', redis: 'rediss' };
const URL_FLAG: Record<TlsSide, string> = { source: '--source', target: '--target', redis: '--redis' };

/** The schemes that connect over TLS: AMQP, the stream protocol, and Redis in its three forms. */
const TLS_SCHEMES = new Set(['amqps', 'rabbitmq-stream+tls', 'rediss', 'rediss-sentinel', 'rediss-cluster']);

function isTlsUrl(url: string): boolean {
  // The Sentinel and Cluster forms are not WHATWG URLs: read the scheme as text.
  const scheme = /^([a-z][a-z0-9+.-]*):\/\//i.exec(url)?.[1]?.toLowerCase();
  return scheme !== undefined && TLS_SCHEMES.has(scheme);
}

/** The TLS form of a plain URL's scheme, for the message that asks for it. */
function tlsSchemeFor(side: TlsSide, plain: string): string {
  // redis-sentinel:// wants rediss-sentinel://, as redis:// wants rediss://.
  if (side === 'redis') return plain.replace(/^redis(?=$|-)/, 'rediss');
  return plain.toLowerCase() === 'rabbitmq-stream' ? 'rabbitmq-stream+tls' : TLS_SCHEME[side];
}

function flag(side: TlsSide, kind: FileKind): string {
  return `--${side}-${kind}`;
}

/** The files of one side, from options named like `targetCa`. */
export function tlsFilesOf(raw: TlsRawOptions, side: TlsSide): TlsFiles {
  const files: TlsFiles = {};
  for (const kind of FILE_KINDS) {
    const value = raw[`${side}${kind[0]?.toUpperCase()}${kind.slice(1)}` as keyof TlsRawOptions];
    if (value !== undefined) files[kind] = value;
  }
  return files;
}

interface TlsPem {
  ca?: Buffer;
  cert?: Buffer;
  key?: Buffer;
}

function readPem(side: TlsSide, files: TlsFiles): TlsPem {
  const pem: TlsPem = {};
  for (const kind of FILE_KINDS) {
    const path = files[kind];
    if (path === undefined) continue;
    try {
      pem[kind] = readFileSync(path);
    } catch (error) {
      const code = (error as NodeJS.ErrnoException).code ?? 'unreadable';
      throw new ConfigError(
        `${flag(side, kind)}: cannot read "${path}" (${code}); give the path of a PEM file`,
      );
    }
  }
  return pem;
}

function checkCertificate(side: TlsSide, kind: FileKind, path: string, pem: Buffer): void {
  checkPemCertificate(flag(side, kind), path, pem);
}

function checkPemCertificate(name: string, path: string, pem: Buffer): void {
  try {
    // Node takes a CA file without a certificate in it and then trusts nothing: say so now.
    if (!pem.includes('-----BEGIN CERTIFICATE-----')) throw new Error('no certificate');
    new X509Certificate(pem);
  } catch {
    throw new ConfigError(`${name}: "${path}" holds no PEM certificate (-----BEGIN CERTIFICATE-----)`);
  }
}

/** Reads a CA file named by `name` (a flag or a config key) and checks it holds a certificate. */
export function readCaFile(name: string, path: string): Buffer {
  let pem: Buffer;
  try {
    pem = readFileSync(path);
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code ?? 'unreadable';
    throw new ConfigError(`${name}: cannot read "${path}" (${code}); give the path of a PEM file`);
  }
  checkPemCertificate(name, path, pem);
  return pem;
}

/**
 * Checks one side's files before anything connects: they go with a TLS URL only (a CA given for an
 * amqp:// URL would be ignored and the connection silently plain), cert and key come together, and
 * each file is readable PEM that fits the other.
 */
export function checkTlsFiles(side: TlsSide, url: string, files: TlsFiles): TlsFiles {
  const given = FILE_KINDS.filter((kind) => files[kind] !== undefined);
  const first = given[0];
  if (first === undefined) return {};
  if (!isTlsUrl(url)) {
    const plain = url.split(':')[0] ?? '';
    const scheme = tlsSchemeFor(side, plain);
    throw new ConfigError(
      `${flag(side, first)}: needs ${URL_FLAG[side]} to be ${scheme}://, not ${plain}://; use ${scheme}:// (with TLS options the bridge never connects plain)`,
    );
  }
  if ((files.cert === undefined) !== (files.key === undefined)) {
    throw new ConfigError(
      `${flag(side, 'cert')} and ${flag(side, 'key')}: give both (the client certificate and its private key) or neither`,
    );
  }
  const pem = readPem(side, files);
  if (pem.ca && files.ca) checkCertificate(side, 'ca', files.ca, pem.ca);
  if (pem.cert && pem.key && files.cert && files.key) {
    checkCertificate(side, 'cert', files.cert, pem.cert);
    try {
      createSecureContext({ cert: pem.cert, key: pem.key });
    } catch (error) {
      const code = (error as { code?: unknown }).code;
      const why =
        code === 'ERR_OSSL_X509_KEY_VALUES_MISMATCH'
          ? 'is not the key of the certificate'
          : 'is not a readable PEM private key (an encrypted key is not supported)';
      throw new ConfigError(`${flag(side, 'key')}: "${files.key}" ${why} in ${flag(side, 'cert')}`);
    }
  }
  return { ...files };
}

/** Checks and collects the three sides' files (see checkTlsFiles). */
export function resolveTlsSettings(
  raw: TlsRawOptions,
  urls: { source: readonly string[]; target: readonly string[]; redis: string },
): TlsSettings {
  // Every URL of a cluster is checked: with TLS options, none of them may be plain.
  const each = (side: 'source' | 'target', list: readonly string[]) =>
    list.map((url) => checkTlsFiles(side, url, tlsFilesOf(raw, side)))[0] ?? {};
  return {
    source: each('source', urls.source),
    target: each('target', urls.target),
    redis: checkTlsFiles('redis', urls.redis, tlsFilesOf(raw, 'redis')),
  };
}

/**
 * The tls.connect options for a TLS URL: our CA and client certificate, certificates always
 * verified, and the URL's host name sent for SNI and checked against the certificate.
 */
function connectOptions(side: TlsSide, url: string, files: TlsFiles | undefined): ConnectionOptions {
  const host = new URL(url).hostname.replace(/^\[|\]$/g, '');
  return {
    ...readPem(side, files ?? {}),
    rejectUnauthorized: true,
    // SNI takes names only; an IP address is still checked against the certificate by Node.
    ...(isIP(host) === 0 ? { servername: host } : {}),
  };
}

/** Socket options for amqplib: TLS options for amqps://, none for amqp://. */
export function amqpTlsOptions(side: TlsSide, url: string, files: TlsFiles | undefined): ConnectionOptions {
  return isTlsUrl(url) ? connectOptions(side, url, files) : {};
}

/**
 * tls.connect options for the stream client (StreamClient.connect's `tls`): our CA and client
 * certificate, always verified, for a rabbitmq-stream+tls:// target; none for rabbitmq-stream://.
 */
export function streamTlsOptions(url: string, files: TlsFiles | undefined): ConnectionOptions {
  return isTlsUrl(url) ? connectOptions('target', url, files) : {};
}

/** Options for ioredis: `tls` for rediss://, none for redis:// (ioredis would use TLS if given). */
export function redisTlsOptions(url: string, files: TlsFiles | undefined): { tls?: ConnectionOptions } {
  return isTlsUrl(url) ? { tls: connectOptions('redis', url, files) } : {};
}

/**
 * The tls.connect options for each server of a Sentinel set or a Cluster: our CA and client
 * certificate, certificates always verified. No servername: each connection is checked against
 * the host it dials (a sentinel, or the address Sentinel or the Cluster announces).
 */
export function redisNodeTlsOptions(files: TlsFiles | undefined): ConnectionOptions {
  return { ...readPem('redis', files ?? {}), rejectUnauthorized: true };
}

// Node's names for a certificate chain it cannot trust with the CAs it was given.
const UNTRUSTED = new Set([
  'UNABLE_TO_VERIFY_LEAF_SIGNATURE',
  'SELF_SIGNED_CERT_IN_CHAIN',
  'DEPTH_ZERO_SELF_SIGNED_CERT',
  'UNABLE_TO_GET_ISSUER_CERT',
  'UNABLE_TO_GET_ISSUER_CERT_LOCALLY',
  'CERT_UNTRUSTED',
  'CERT_SIGNATURE_FAILURE',
  'CERT_REJECTED',
  'INVALID_CA',
  'INVALID_PURPOSE',
]);
const NOT_VALID_NOW = new Set(['CERT_HAS_EXPIRED', 'CERT_NOT_YET_VALID', 'CERT_REVOKED']);
// Alerts the server sends when it does not accept our client certificate (or its absence).
const CLIENT_CERT_REFUSED = new Set([
  'ERR_SSL_TLSV13_ALERT_CERTIFICATE_REQUIRED',
  'ERR_SSL_SSLV3_ALERT_HANDSHAKE_FAILURE',
  'ERR_SSL_SSLV3_ALERT_BAD_CERTIFICATE',
  'ERR_SSL_SSLV3_ALERT_CERTIFICATE_UNKNOWN',
  'ERR_SSL_SSLV3_ALERT_CERTIFICATE_EXPIRED',
  'ERR_SSL_TLSV1_ALERT_UNKNOWN_CA',
  'ERR_SSL_TLSV1_ALERT_ACCESS_DENIED',
]);
// What OpenSSL says when the other end answers in something that is not TLS.
const NOT_TLS = new Set([
  'ERR_SSL_WRONG_VERSION_NUMBER',
  'ERR_SSL_PACKET_LENGTH_TOO_LONG',
  'ERR_SSL_HTTP_REQUEST',
]);
// Node 24 offers TLS 1.2 and 1.3 only; a server that takes neither, or no cipher of theirs, fails so.
const HANDSHAKE_ADVICE = 'check that the server accepts TLS 1.2 or 1.3 with a common cipher';
// NOT_TLS, as OpenSSL words it in an EPROTO error: "...:SSL routines:<function>:<reason>:<file>:<line>:".
const OPENSSL_REASON = /SSL routines:[^:]*:([^:]+):/;
const NOT_TLS_REASONS = new Set(['wrong version number', 'packet length too long', 'http request']);

/**
 * Names a TLS failure and its fix, or undefined when the error is not about TLS. None of these
 * are retried: another attempt meets the same certificate.
 */
export function tlsFailure(
  error: unknown,
  side: TlsSide,
  prefix = `--${side}`,
  /** Whether the user can give this connection a client certificate (not the management API). */
  clientCertificate = true,
): string | undefined {
  const flag = (_side: TlsSide, kind: FileKind) => `${prefix}-${kind}`;
  const code = (error as { code?: unknown } | undefined)?.code;
  if (typeof code !== 'string') return undefined;
  if (UNTRUSTED.has(code)) return `TLS certificate not trusted (${code}); check ${flag(side, 'ca')}`;
  if (NOT_VALID_NOW.has(code)) {
    return `TLS certificate not valid now (${code}); renew the server's certificate or check this machine's clock`;
  }
  if (code === 'ERR_TLS_CERT_ALTNAME_INVALID') {
    const host = (error as { host?: unknown }).host;
    const named = typeof host === 'string' ? ` "${host}"` : '';
    return `TLS certificate does not name the host${named} (${code}); connect by a host name or address the certificate lists`;
  }
  if (CLIENT_CERT_REFUSED.has(code)) {
    if (!clientCertificate)
      return `the server refused the TLS handshake (${code}): it asks for a client certificate, and ${prefix} sends none; let it accept clients without one`;
    return `the server refused the TLS handshake (${code}); check ${flag(side, 'cert')} and ${flag(side, 'key')} (a client certificate signed by a CA the server trusts)`;
  }
  if (NOT_TLS.has(code))
    return `the server does not speak TLS on this port (${code}); check the port in the URL`;
  if (code === 'EPROTO') {
    // Node's https client reports a failed handshake so, with OpenSSL's whole error line (its
    // source file, a newline) as the message: name only OpenSSL's reason.
    const reason = OPENSSL_REASON.exec((error as Error).message)?.[1];
    if (reason === undefined) return undefined;
    if (NOT_TLS_REASONS.has(reason))
      return `the server does not speak TLS on this port (${reason}); check the port in the URL`;
    return `TLS handshake failed (${reason}); ${HANDSHAKE_ADVICE}`;
  }
  if (code.startsWith('ERR_SSL_')) return `TLS handshake failed (${code}); ${HANDSHAKE_ADVICE}`;
  return undefined;
}
