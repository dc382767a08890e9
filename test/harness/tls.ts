import { spawnSync } from 'node:child_process';
import { mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { freePort, freeRedisPort, haveLocalServers, newRunDir, RabbitNode, RedisServer } from './servers.js';

/** The PEM files a TLS test needs, made by openssl in the test's own folder. */
export interface TestCertificates {
  /** The CA that signed the server and client certificates. */
  ca: string;
  /** A second CA that signed nothing we use: trusting it alone must fail. */
  wrongCa: string;
  /** The servers' certificate: names only IP 127.0.0.1, so "localhost" does not match it. */
  serverCert: string;
  serverKey: string;
  /** A client certificate signed by `ca`, for brokers and Redis that verify their peers. */
  clientCert: string;
  clientKey: string;
}

function openssl(dir: string, ...args: string[]): void {
  const result = spawnSync('openssl', args, { cwd: dir, encoding: 'utf8' });
  if (result.status !== 0) {
    throw new Error(`harness: openssl ${args.join(' ')} failed: ${(result.stderr || result.stdout).trim()}`);
  }
}

function makeCa(dir: string, name: string): void {
  openssl(dir, 'genpkey', '-algorithm', 'EC', '-pkeyopt', 'ec_paramgen_curve:P-256', '-out', `${name}.key`);
  openssl(
    dir,
    ...['req', '-x509', '-new', '-key', `${name}.key`, '-sha256', '-days', '2', '-subj'],
    `/CN=dedup-bridge test ${name}`,
    ...['-addext', 'basicConstraints=critical,CA:TRUE', '-addext', 'keyUsage=critical,keyCertSign'],
    ...['-out', `${name}.pem`],
  );
}

/** A certificate `<name>.pem` (and `<name>.key`) signed by the CA in `dir`, for `usage` (extendedKeyUsage). */
export function makeLeaf(dir: string, name: string, usage: string, san: string | undefined): void {
  openssl(dir, 'genpkey', '-algorithm', 'EC', '-pkeyopt', 'ec_paramgen_curve:P-256', '-out', `${name}.key`);
  openssl(
    dir,
    'req',
    '-new',
    '-key',
    `${name}.key`,
    '-subj',
    `/CN=dedup-bridge test ${name}`,
    '-out',
    `${name}.csr`,
  );
  const extensions = [`extendedKeyUsage=${usage}`, 'basicConstraints=CA:FALSE'];
  if (san) extensions.push(`subjectAltName=${san}`);
  writeFileSync(join(dir, `${name}.ext`), `${extensions.join('\n')}\n`);
  openssl(
    dir,
    ...['x509', '-req', '-in', `${name}.csr`, '-CA', 'ca.pem', '-CAkey', 'ca.key', '-CAcreateserial'],
    ...['-days', '2', '-sha256', '-extfile', `${name}.ext`, '-out', `${name}.pem`],
  );
}

/** A CA, a server and a client certificate signed by it, and an unrelated "wrong" CA. */
export function makeCertificates(dir: string): TestCertificates {
  mkdirSync(dir, { recursive: true });
  makeCa(dir, 'ca');
  makeCa(dir, 'wrong-ca');
  makeLeaf(dir, 'server', 'serverAuth', 'IP:127.0.0.1');
  makeLeaf(dir, 'client', 'clientAuth', undefined);
  return {
    ca: join(dir, 'ca.pem'),
    wrongCa: join(dir, 'wrong-ca.pem'),
    serverCert: join(dir, 'server.pem'),
    serverKey: join(dir, 'server.key'),
    clientCert: join(dir, 'client.pem'),
    clientKey: join(dir, 'client.key'),
  };
}

/** A RabbitMQ node and a Redis that each listen both plain and with TLS, for the TLS tests. */
export interface TlsServers {
  certs: TestCertificates;
  rabbit: RabbitNode;
  /** The node's TLS listener (peers must show a client certificate signed by `certs.ca`). */
  amqpsPort: number;
  /** The node's management API over https (no client certificate asked). */
  managementTlsPort: number;
  /** The node's stream-protocol TLS listener (as amqpsPort: client certificates verified). */
  streamTlsPort: number;
  redis: RedisServer;
  /** Redis's TLS port (clients must show a certificate signed by `certs.ca`). */
  redissPort: number;
  stop(): Promise<void>;
}

/**
 * Starts the TLS servers in a folder of their own (under the harness's run folder when there is
 * one, so an interrupted run's leftovers are cleaned like the others).
 */
export async function startTlsServers(harnessRunDir: string): Promise<TlsServers> {
  if (!haveLocalServers()) {
    throw new Error(
      'harness: the TLS tests start their own RabbitMQ and Redis; install rabbitmq-server and redis-server',
    );
  }
  const runDir = harnessRunDir || newRunDir();
  const amqpsPort = await freePort();
  const managementTlsPort = await freePort();
  const redissPort = await freeRedisPort();
  const streamTlsPort = await freePort();
  const streamPort = await freePort();
  // The node runs as the rabbitmq user: its files go inside its folder, which RabbitNode chowns.
  const certs = makeCertificates(join(runDir, 'tls-rabbit', 'certs'));
  const rabbit = new RabbitNode(runDir, 'tls-rabbit', {
    management: true,
    plugins: ['rabbitmq_stream'],
    config: [
      // The stream plugin takes ssl_options too; its plain port moved off the default 5552.
      `stream.listeners.ssl.1 = ${streamTlsPort}`,
      `stream.listeners.tcp.1 = ${streamPort}`,
      `management.ssl.port = ${managementTlsPort}`,
      'management.ssl.ip = 127.0.0.1',
      `management.ssl.cacertfile = ${certs.ca}`,
      `management.ssl.certfile = ${certs.serverCert}`,
      `management.ssl.keyfile = ${certs.serverKey}`,
      `listeners.ssl.default = ${amqpsPort}`,
      `ssl_options.cacertfile = ${certs.ca}`,
      `ssl_options.certfile = ${certs.serverCert}`,
      `ssl_options.keyfile = ${certs.serverKey}`,
      'ssl_options.verify = verify_peer',
      'ssl_options.fail_if_no_peer_cert = true',
    ],
  });
  const redis = new RedisServer(runDir, 'tls-redis', false, [
    ...['--tls-port', String(redissPort), '--tls-ca-cert-file', certs.ca],
    ...['--tls-cert-file', certs.serverCert, '--tls-key-file', certs.serverKey, '--tls-auth-clients', 'yes'],
  ]);
  // Killed, not stopped: thrown away, and a graceful stop of a node with management takes seconds.
  const stop = async () => {
    await Promise.allSettled([rabbit.stop(true), redis.stop(true)]);
    if (!harnessRunDir) rmSync(runDir, { recursive: true, force: true });
  };
  try {
    await Promise.all([rabbit.start(), redis.start()]);
  } catch (error) {
    await stop();
    throw error;
  }
  return { certs, rabbit, amqpsPort, managementTlsPort, streamTlsPort, redis, redissPort, stop };
}
