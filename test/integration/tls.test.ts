import { readFileSync } from 'node:fs';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { QueueTarget } from '../../src/amqp/queue-target.js';
import { createLogger } from '../../src/observe/log.js';
import type { PublishOutcome } from '../../src/ports.js';
import { StreamClient } from '../../src/stream/client.js';
import { startTlsServers, type TlsServers } from '../harness/tls.js';
import {
  type CliResult,
  countDelivery,
  declareQueue,
  delivered,
  depthOf,
  lines,
  numbered,
  publishAll,
  runCli,
  servers,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
  withOption,
} from '../helpers.js';
import { basicProperties, field, longString, table } from '../wire.js';

// One RabbitMQ node and one Redis, each with a plain and a TLS port, with certificates made for
// this run: only this file pays for starting them.
let tls: TlsServers;

beforeAll(async () => {
  tls = await startTlsServers(servers().runDir);
});

afterAll(async () => {
  await tls?.stop();
});

/** The node's plain listener: the test itself uses it to set up and count; the bridge must not. */
function plainAmqp(): string {
  return tls.rabbit.url;
}

function amqps(host = '127.0.0.1', port = tls.amqpsPort): string {
  return `amqps://guest:guest@${host}:${port}`;
}

function rediss(host = '127.0.0.1', port = tls.redissPort): string {
  return `rediss://${host}:${port}`;
}

/** --<side>-ca, and the client certificate both servers ask for. */
function tlsFlags(side: 'source' | 'target' | 'redis', ca = tls.certs.ca): string[] {
  return [
    ...[`--${side}-ca`, ca],
    ...[`--${side}-cert`, tls.certs.clientCert, `--${side}-key`, tls.certs.clientKey],
  ];
}

/** A source and a target queue on the TLS node, with `count` messages waiting in the source. */
async function tlsQueues(count: number): Promise<{ source: string; target: string }> {
  const source = uniqueName('tls-src');
  const target = uniqueName('tls-dst');
  await declareQueue(plainAmqp(), source);
  await declareQueue(plainAmqp(), target);
  if (count > 0) await publishAll(plainAmqp(), source, numbered('tls', count).messages);
  return { source, target };
}

/** `run` over TLS on every side; `change` replaces flags (e.g. a URL or a CA) by name. */
function tlsRunArgs(source: string, target: string, change: Record<string, string> = {}): string[] {
  const args = [
    'run',
    ...['--source', amqps(), '--source-queue', source, ...tlsFlags('source')],
    ...['--target', amqps(), '--target-queue', target, ...tlsFlags('target')],
    ...['--redis', rediss(), ...tlsFlags('redis')],
  ];
  return args.map((value, index) => change[args[index - 1] as string] ?? value);
}

/** The one stderr line of a refused start: no stack trace, nothing else said. */
function onlyLine(result: CliResult): string {
  expect(result.stderr).not.toMatch(/\n\s+at /);
  const lines = result.stderr.split('\n').filter((line) => line.length > 0);
  expect(lines).toHaveLength(1);
  return lines[0] as string;
}

/** The bridge's connections to the TLS node: its name, whether TLS, and the node's port. */
async function bridgeConnections(): Promise<string[]> {
  const out = await tls.rabbit.ctl(
    'list_connections',
    'ssl',
    'port',
    'client_properties',
    '--no-table-headers',
    '-q',
  );
  return out
    .split('\n')
    .map((line) => {
      const [ssl, port] = line.split('\t');
      const name = /"connection_name","([^"]+)"/.exec(line)?.[1];
      return name?.startsWith('dedup-bridge') ? `${name} ssl=${ssl} port=${port}` : '';
    })
    .filter((line) => line.length > 0)
    .sort();
}

describe('TLS (amqps:// and rediss://)', () => {
  it('a fenced target connection over amqps is reset like a plain one, without an exception, and reconnects', async () => {
    // A TLS socket has no TCP handle to reset: Node throws ERR_INVALID_HANDLE_TYPE, which used to
    // escape the fence (from a timer or the write gate) and end the process.
    const queue = uniqueName('tls-fence');
    await declareQueue(plainAmqp(), queue);
    const target = new QueueTarget(
      {
        urls: [amqps()],
        exchange: '',
        routingKey: queue,
        queue,
        retryForMs: 10_000,
        tls: { ca: tls.certs.ca, cert: tls.certs.clientCert, key: tls.certs.clientKey },
        stop: undefined,
      },
      createLogger('silent'),
    );
    await target.start();
    try {
      const publish = (id: string) =>
        new Promise<PublishOutcome>((resolve) =>
          target.send(
            {
              properties: basicProperties({ headers: table(field('_HQ_DUPL_ID', longString(id))) }),
              content: Buffer.from(id),
              routingKey: '',
              id: longString(id).toString('latin1'),
              writeBy: performance.now() + 10_000,
            },
            resolve,
          ),
        );
      expect(await publish('before-the-reset')).toBe('stored');
      const wasDown = waitFor(() => !target.isUp, 15_000, 5);
      expect(() => target.reset('a test of the fence over TLS')).not.toThrow();
      expect(await wasDown, 'the reset dropped the connection').toBe(true);
      expect(await waitFor(() => target.isUp, 15_000)).toBe(true);
      expect(await publish('after-the-reset')).toBe('stored');
      const ids = (await takeAll(plainAmqp(), queue)).map((message) =>
        String(message.properties.headers?._HQ_DUPL_ID),
      );
      expect(ids).toEqual(['before-the-reset', 'after-the-reset']);
    } finally {
      await target.close();
    }
  });

  it('run forwards over amqps on both sides and rediss with the right CA, through the TLS listener only', async () => {
    const { source, target } = await tlsQueues(300);
    await publishAll(plainAmqp(), source, numbered('tls', 100).messages); // resent: must not arrive twice
    const bridge = startCli(tlsRunArgs(source, target));
    expect(await waitFor(async () => (await depthOf(plainAmqp(), source)) === 0)).toBe(true);
    // The node also listens plain; the bridge's two connections are on the TLS port.
    expect(await bridgeConnections()).toEqual([
      `dedup-bridge source ssl=true port=${tls.amqpsPort}`,
      `dedup-bridge target ssl=true port=${tls.amqpsPort}`,
    ]);
    bridge.signal('SIGTERM');
    expect((await bridge.done).code).toBe(0);
    const { count } = await delivered(
      'run over TLS, 300 + 100 resent',
      plainAmqp(),
      target,
      numbered('tls', 300).ids,
    );
    expect(count).toMatchObject({ received: 300, lost: 0, duplicated: 0, unexpected: 0 });

    // The cache tools reach the same Redis over TLS.
    const stats = await runCli([
      ...['cache', 'stats', '--scope', `queue:${target}`, '--redis', rediss(), ...tlsFlags('redis')],
    ]);
    expect(stats.stderr).toBe('');
    expect(stats.stdout).toContain(`scope queue:${target}: 300 committed IDs`);
  });

  it('migrate writes into a stream over rabbitmq-stream+tls://, with the CA and client certificate', async () => {
    const { source } = await tlsQueues(200);
    const stream = uniqueName('tls-stream');
    const streamTls = `rabbitmq-stream+tls://guest:guest@127.0.0.1:${tls.streamTlsPort}/`;
    const args = [
      'migrate',
      ...['--source', amqps(), '--source-queue', source, ...tlsFlags('source')],
      ...['--target', streamTls, '--target-stream', stream, '--declare-target', ...tlsFlags('target')],
      ...['--redis', rediss(), ...tlsFlags('redis')],
      ...['--idle-timeout', '300ms', '--quiet'],
    ];
    const result = await runCli(args);
    expect(result.stderr).toBe('');
    expect(result.code).toBe(0);
    const reader = await StreamClient.connect({
      url: streamTls,
      tls: {
        ca: readFileSync(tls.certs.ca),
        cert: readFileSync(tls.certs.clientCert),
        key: readFileSync(tls.certs.clientKey),
      },
    });
    try {
      const stored = await reader.readStream(stream, { count: 200, idleMs: 2000 });
      const ids = stored.map((message) => /tls-\d+/.exec(message.data.toString('latin1'))?.[0] ?? '');
      const count = countDelivery('migrate into a stream over TLS', numbered('tls', 200).ids, ids);
      expect(count).toMatchObject({ received: 200, lost: 0, duplicated: 0, unexpected: 0 });
    } finally {
      await reader.close();
    }

    // Trusting another CA, the stream endpoint's certificate is refused: one line, exit 2.
    const wrong = await runCli(withOption(args, '--target-ca', tls.certs.wrongCa));
    expect(wrong.code).toBe(2);
    expect(lines(wrong.stderr)).toHaveLength(1);
    expect(wrong.stderr).toMatch(/certificate/i);
  });

  it('migrate drains a queue over TLS and deletes it when empty', async () => {
    const { source, target } = await tlsQueues(100);
    const args = tlsRunArgs(source, target).slice(1);
    const result = await runCli([
      'migrate',
      ...args,
      '--idle-timeout',
      '300ms',
      '--delete-source-when-empty',
      '--quiet',
    ]);
    expect(result.stderr).not.toContain('dedup-bridge:');
    expect(result.code).toBe(0);
    const { count } = await delivered('migrate over TLS', plainAmqp(), target, numbered('tls', 100).ids);
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
    await expect(depthOf(plainAmqp(), source)).rejects.toThrow(/NOT_FOUND/);
  });

  it('the management API over https trusts the CA of --source-management-ca (migrate --declare-target), and refuses an untrusted one', async () => {
    const source = uniqueName('tls-shape');
    const target = uniqueName('tls-declared');
    const shape = { 'x-dead-letter-exchange': 'dlx', 'x-max-priority': 3 };
    await declareQueue(plainAmqp(), source, { arguments: shape });
    await publishAll(plainAmqp(), source, numbered('tls', 20).messages);
    const management = (host = '127.0.0.1') => `https://guest:guest@${host}:${tls.managementTlsPort}`;
    const migrate = (...extra: string[]) =>
      runCli([
        'migrate',
        ...tlsRunArgs(source, target).slice(1),
        ...['--idle-timeout', '300ms', '--quiet', '--declare-target', ...extra],
      ]);

    // The system CAs (the default) and a CA that did not sign it: refused at once, nothing moved.
    for (const [extra, why] of [
      [
        ['--source-management', management()],
        /TLS certificate not trusted \([A-Z_]+\); check --source-management-ca$/,
      ],
      [
        ['--source-management', management(), '--source-management-ca', tls.certs.wrongCa],
        /TLS certificate not trusted \([A-Z_]+\); check --source-management-ca$/,
      ],
      [
        ['--source-management', management('localhost'), '--source-management-ca', tls.certs.ca],
        /TLS certificate does not name the host "localhost"/,
      ],
      [
        ['--source-management', tls.rabbit.managementUrl, '--source-management-ca', tls.certs.ca],
        /^dedup-bridge: --source-management-ca: needs --source-management to be https:\/\/, not http:\/\//,
      ],
      [
        // https:// to the plain HTTP port: OpenSSL's reason, on one line.
        ['--source-management', tls.rabbit.managementUrl.replace(/^http:/, 'https:')],
        /: the server does not speak TLS on this port \(wrong version number\); check the port in the URL$/,
      ],
    ] as const) {
      const refused = await migrate(...extra);
      expect(refused.code, refused.stderr).toBe(2);
      expect(onlyLine(refused)).toMatch(why);
      expect(refused.stderr).not.toContain('guest:guest');
    }
    expect(await depthOf(plainAmqp(), source)).toBe(20);
    await expect(depthOf(plainAmqp(), target)).rejects.toThrow(/NOT_FOUND/);

    const result = await migrate('--source-management', management(), '--source-management-ca', tls.certs.ca);
    expect(result.code, result.stderr).toBe(0);
    expect(await depthOf(plainAmqp(), source)).toBe(0);
    // Declared like its source (the same arguments are accepted), and holding every message.
    await declareQueue(plainAmqp(), target, { arguments: shape });
    const { count } = await delivered(
      'declared through the https management API',
      plainAmqp(),
      target,
      numbered('tls', 20).ids,
    );
    expect(count).toMatchObject({ lost: 0, duplicated: 0, unexpected: 0 });
  });

  it('a CA that did not sign the server certificate is refused at once: one line, exit 2, nothing moved', async () => {
    const { source, target } = await tlsQueues(5);
    // `run` retries unreachable servers forever by default: these must end by themselves.
    const [broker, redis] = await Promise.all([
      runCli(tlsRunArgs(source, target, { '--target-ca': tls.certs.wrongCa }), { timeoutMs: 30_000 }),
      runCli(tlsRunArgs(source, target, { '--redis-ca': tls.certs.wrongCa }), { timeoutMs: 30_000 }),
    ]);
    expect(broker.code).toBe(2);
    expect(onlyLine(broker)).toMatch(
      new RegExp(
        `^dedup-bridge: target broker at amqps://guest:\\*\\*\\*@127\\.0\\.0\\.1:${tls.amqpsPort}: TLS certificate not trusted \\([A-Z_]+\\); check --target-ca$`,
      ),
    );
    expect(redis.code).toBe(2);
    expect(onlyLine(redis)).toMatch(
      new RegExp(
        `^dedup-bridge: Redis at rediss://127\\.0\\.0\\.1:${tls.redissPort}: TLS certificate not trusted \\([A-Z_]+\\); check --redis-ca$`,
      ),
    );
    expect(await depthOf(plainAmqp(), source)).toBe(5);
    expect(await depthOf(plainAmqp(), target)).toBe(0);
  });

  it('a host name the certificate does not list is refused (the certificate names 127.0.0.1 only)', async () => {
    const { source, target } = await tlsQueues(0);
    const [broker, redis] = await Promise.all([
      runCli(tlsRunArgs(source, target, { '--source': amqps('localhost') }), { timeoutMs: 30_000 }),
      runCli(tlsRunArgs(source, target, { '--redis': rediss('localhost') }), { timeoutMs: 30_000 }),
    ]);
    expect(broker.code).toBe(2);
    expect(onlyLine(broker)).toBe(
      `dedup-bridge: source broker at amqps://guest:***@localhost:${tls.amqpsPort}: TLS certificate does not name the host "localhost" (ERR_TLS_CERT_ALTNAME_INVALID); connect by a host name or address the certificate lists`,
    );
    expect(redis.code).toBe(2);
    expect(onlyLine(redis)).toBe(
      `dedup-bridge: Redis at rediss://localhost:${tls.redissPort}: TLS certificate does not name the host "localhost" (ERR_TLS_CERT_ALTNAME_INVALID); connect by a host name or address the certificate lists`,
    );
  });

  it('a server that wants a client certificate refuses the bridge without one', async () => {
    const { source, target } = await tlsQueues(0);
    const args = tlsRunArgs(source, target).filter(
      (value, index, all) =>
        !/^--target-(cert|key)$/.test(value) && !/^--target-(cert|key)$/.test(all[index - 1] ?? ''),
    );
    const result = await runCli(args, { timeoutMs: 30_000 });
    expect(result.code).toBe(2);
    expect(onlyLine(result)).toMatch(
      /^dedup-bridge: target broker at amqps:\/\/guest:\*\*\*@127\.0\.0\.1:\d+: the server refused the TLS handshake \(ERR_SSL_[A-Z0-9_]+\); check --target-cert and --target-key/,
    );
  });

  it('never falls back to plain: amqps:// or rediss:// at a plain port fails, TLS options on a plain URL are refused', async () => {
    const { source, target } = await tlsQueues(5);
    const [amqpsAtPlain, redissAtPlain, caOnPlainAmqp, caOnPlainRedis] = await Promise.all([
      runCli(tlsRunArgs(source, target, { '--target': amqps('127.0.0.1', tls.rabbit.port) }), {
        timeoutMs: 30_000,
      }),
      // Redis may not answer a TLS hello at all: bound the wait.
      runCli(
        [
          ...tlsRunArgs(source, target, { '--redis': rediss('127.0.0.1', tls.redis.port) }),
          '--retry-for',
          '2s',
        ],
        {
          timeoutMs: 30_000,
        },
      ),
      runCli(tlsRunArgs(source, target, { '--source': plainAmqp() }), { timeoutMs: 30_000 }),
      runCli(tlsRunArgs(source, target, { '--redis': tls.redis.url }), { timeoutMs: 30_000 }),
    ]);
    expect(amqpsAtPlain.code).toBe(2);
    expect(onlyLine(amqpsAtPlain)).toBe(
      `dedup-bridge: target broker at amqps://guest:***@127.0.0.1:${tls.rabbit.port}: the server does not speak TLS on this port (ERR_SSL_WRONG_VERSION_NUMBER); check the port in the URL`,
    );
    // Refused (a garbled answer) or unanswered (Redis waits for the end of a line): either way, no plain session.
    expect([1, 2]).toContain(redissAtPlain.code);
    expect(onlyLine(redissAtPlain)).toMatch(
      new RegExp(`^dedup-bridge: Redis at rediss://127\\.0\\.0\\.1:${tls.redis.port}(: TLS| is unreachable)`),
    );
    // Unanswered: the line names the likely cause, a port that does not speak TLS.
    if (redissAtPlain.code === 1) {
      expect(onlyLine(redissAtPlain)).toMatch(
        /, and that the port speaks TLS \(a plain Redis port never answers the TLS greeting\)$/,
      );
    }
    expect(caOnPlainAmqp.code).toBe(2);
    expect(onlyLine(caOnPlainAmqp)).toBe(
      'dedup-bridge: --source-ca: needs --source to be amqps://, not amqp://; use amqps:// (with TLS options the bridge never connects plain)',
    );
    expect(caOnPlainRedis.code).toBe(2);
    expect(onlyLine(caOnPlainRedis)).toBe(
      'dedup-bridge: --redis-ca: needs --redis to be rediss://, not redis://; use rediss:// (with TLS options the bridge never connects plain)',
    );
    expect(await depthOf(plainAmqp(), source)).toBe(5);
    expect(await depthOf(plainAmqp(), target)).toBe(0);
  });

  it('unreadable or mismatched certificate files are usage errors naming the flag and the file', async () => {
    const { source, target } = await tlsQueues(0);
    const missing = `${tls.certs.ca}.missing`;
    const results = await Promise.all([
      runCli(tlsRunArgs(source, target, { '--target-ca': missing })),
      runCli(tlsRunArgs(source, target, { '--redis-key': tls.certs.serverKey })),
      runCli(tlsRunArgs(source, target, { '--source-ca': tls.certs.clientKey })),
      runCli(
        tlsRunArgs(source, target).filter(
          (value, index, all) => value !== '--source-key' && all[index - 1] !== '--source-key',
        ),
      ),
    ]);
    expect(results.map((result) => result.code)).toEqual([2, 2, 2, 2]);
    expect(results.map(onlyLine)).toEqual([
      `dedup-bridge: --target-ca: cannot read "${missing}" (ENOENT); give the path of a PEM file`,
      `dedup-bridge: --redis-key: "${tls.certs.serverKey}" is not the key of the certificate in --redis-cert`,
      `dedup-bridge: --source-ca: "${tls.certs.clientKey}" holds no PEM certificate (-----BEGIN CERTIFICATE-----)`,
      'dedup-bridge: --source-cert and --source-key: give both (the client certificate and its private key) or neither',
    ]);
  });
});
