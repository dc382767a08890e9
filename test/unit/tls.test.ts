import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import { classifyConnectError } from '../../src/amqp/errors.js';
import { resolveBridgeSettings } from '../../src/config/settings.js';
import { amqpTlsOptions, redisTlsOptions, tlsFailure } from '../../src/config/tls.js';
import { FatalConnectError } from '../../src/errors.js';
import { makeCertificates } from '../harness/tls.js';

/** An error as Node's socket and TLS layers raise them: a message and a code. */
function nodeError(code: string, extra: Record<string, unknown> = {}): Error {
  return Object.assign(new Error(`failed: ${code}`), { code, ...extra });
}

describe('TLS failures are told apart from network failures', () => {
  it.each([
    [
      'UNABLE_TO_VERIFY_LEAF_SIGNATURE',
      'TLS certificate not trusted (UNABLE_TO_VERIFY_LEAF_SIGNATURE); check --target-ca',
    ],
    [
      'SELF_SIGNED_CERT_IN_CHAIN',
      'TLS certificate not trusted (SELF_SIGNED_CERT_IN_CHAIN); check --target-ca',
    ],
    [
      'DEPTH_ZERO_SELF_SIGNED_CERT',
      'TLS certificate not trusted (DEPTH_ZERO_SELF_SIGNED_CERT); check --target-ca',
    ],
    [
      'CERT_HAS_EXPIRED',
      "TLS certificate not valid now (CERT_HAS_EXPIRED); renew the server's certificate or check this machine's clock",
    ],
    [
      'ERR_SSL_WRONG_VERSION_NUMBER',
      'the server does not speak TLS on this port (ERR_SSL_WRONG_VERSION_NUMBER); check the port in the URL',
    ],
    [
      'ERR_SSL_TLSV1_ALERT_UNKNOWN_CA',
      'the server refused the TLS handshake (ERR_SSL_TLSV1_ALERT_UNKNOWN_CA); check --target-cert and --target-key (a client certificate signed by a CA the server trusts)',
    ],
    [
      'ERR_SSL_NO_SHARED_CIPHER',
      'TLS handshake failed (ERR_SSL_NO_SHARED_CIPHER); check that the server accepts TLS 1.2 or 1.3 with a common cipher',
    ],
  ])('%s is a fatal refusal with its fix', (code, text) => {
    expect(tlsFailure(nodeError(code), 'target')).toBe(text);
    const fatal = classifyConnectError(nodeError(code), 'target broker at amqps://mq:5671', 'target');
    expect(fatal).toBeInstanceOf(FatalConnectError);
    expect(fatal?.exitCode).toBe(2);
    expect(fatal?.message).toBe(`target broker at amqps://mq:5671: ${text}`);
  });

  it("Node's https client's EPROTO names OpenSSL's reason only, on one line", () => {
    const https = (reason: string) =>
      Object.assign(
        new Error(
          `write EPROTO 40FD811B0B7F0000:error:0A00010B:SSL routines:tls_validate_record_header:${reason}:../deps/openssl/openssl/ssl/record/methods/tlsany_meth.c:77:\n`,
        ),
        { code: 'EPROTO' },
      );
    expect(tlsFailure(https('wrong version number'), 'source', '--source-management')).toBe(
      'the server does not speak TLS on this port (wrong version number); check the port in the URL',
    );
    expect(tlsFailure(https('unsupported protocol'), 'source', '--source-management')).toBe(
      'TLS handshake failed (unsupported protocol); check that the server accepts TLS 1.2 or 1.3 with a common cipher',
    );
    // The management API takes no client certificate: no flag to check is named.
    expect(
      tlsFailure(
        nodeError('ERR_SSL_TLSV13_ALERT_CERTIFICATE_REQUIRED'),
        'source',
        '--source-management',
        false,
      ),
    ).toBe(
      'the server refused the TLS handshake (ERR_SSL_TLSV13_ALERT_CERTIFICATE_REQUIRED): it asks for a client certificate, and --source-management sends none; let it accept clients without one',
    );
    // An EPROTO without OpenSSL's words is no TLS failure this can name.
    expect(tlsFailure(nodeError('EPROTO'), 'source')).toBeUndefined();
  });

  it('names the host a certificate does not list', () => {
    expect(tlsFailure(nodeError('ERR_TLS_CERT_ALTNAME_INVALID', { host: 'mq-b' }), 'redis')).toBe(
      'TLS certificate does not name the host "mq-b" (ERR_TLS_CERT_ALTNAME_INVALID); connect by a host name or address the certificate lists',
    );
  });

  it.each(['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'ENOTFOUND', 'EPIPE'])(
    '%s stays a network failure, retried',
    (code) => {
      expect(tlsFailure(nodeError(code), 'source')).toBeUndefined();
      expect(classifyConnectError(nodeError(code), 'source broker', 'source')).toBeUndefined();
    },
  );
});

describe('TLS connect options', () => {
  it('amqps:// verifies the certificate and sends the host name for SNI (not an IP address)', () => {
    expect(amqpTlsOptions('target', 'amqps://u:p@mq-b.example:5671/v', undefined)).toEqual({
      rejectUnauthorized: true,
      servername: 'mq-b.example',
    });
    expect(amqpTlsOptions('target', 'amqps://u:p@10.0.0.7:5671', undefined)).toEqual({
      rejectUnauthorized: true,
    });
  });

  it('plain URLs get no TLS options at all (ioredis would switch to TLS on any)', () => {
    expect(amqpTlsOptions('source', 'amqp://u:p@mq-a:5672', { ca: '/nowhere/ca.pem' })).toEqual({});
    expect(redisTlsOptions('redis://cache:6379', { ca: '/nowhere/ca.pem' })).toEqual({});
  });

  it('reads the files into the options, and resolves them into the settings per server', () => {
    const dir = mkdtempSync(join(tmpdir(), 'dedup-tls-unit-'));
    onTestFinished(() => rmSync(dir, { recursive: true, force: true }));
    const certs = makeCertificates(dir);
    const settings = resolveBridgeSettings(
      {
        source: 'amqp://guest:guest@mq-a:5672',
        sourceQueue: 'orders',
        target: 'amqps://guest:guest@mq-b:5671',
        targetQueue: 'orders',
        targetCa: certs.ca,
        targetCert: certs.clientCert,
        targetKey: certs.clientKey,
        redis: 'rediss://cache:6380',
        redisCa: certs.ca,
      },
      'run',
    );
    expect(settings.tls).toEqual({
      source: {},
      target: { ca: certs.ca, cert: certs.clientCert, key: certs.clientKey },
      redis: { ca: certs.ca },
    });
    const redis = redisTlsOptions(settings.redisUrl, settings.tls.redis).tls;
    expect(redis?.ca?.toString()).toContain('-----BEGIN CERTIFICATE-----');
    expect(redis?.servername).toBe('cache');
    const amqp = amqpTlsOptions('target', settings.targetUrl, settings.tls.target);
    expect(amqp.key?.toString()).toContain('PRIVATE KEY');
  });
});
