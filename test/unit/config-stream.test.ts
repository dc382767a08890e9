import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Command } from 'commander';
import { afterEach, describe, expect, it } from 'vitest';
import { stringify } from 'yaml';
import { addBridgeOptions } from '../../src/cli/options.js';
import { describeConfig, loadConfigFile, loadConfigRoutes } from '../../src/config/file.js';
import { resolveMigrateSettings } from '../../src/config/migrate-settings.js';
import { redactUrl } from '../../src/config/redact.js';
import { type RawOptions, resolveBridgeSettings } from '../../src/config/settings.js';
import { ConfigError } from '../../src/errors.js';
import { makeCertificates } from '../harness/tls.js';
import { catchError } from '../helpers.js';

// A RabbitMQ stream as target (issue 30): --target rabbitmq-stream://… with --target-stream, in
// flags, variables, config files and migrate; every refusal one line, exit 2, no password.

const SECRET = 'hunter2-Str3amSecret';
const STREAM_URL = `rabbitmq-stream://bridge:${SECRET}@streams.example:5552/prod`;
const folder = mkdtempSync(join(tmpdir(), 'dedup-config-stream-'));
let files = 0;

function base(overrides: RawOptions = {}): RawOptions {
  return {
    source: `amqp://bridge:${SECRET}@old:5672`,
    sourceQueue: 'orders',
    target: STREAM_URL,
    targetStream: 'orders-stream',
    ...overrides,
  };
}

/** The refusal's line: a ConfigError (exit 2) whose text holds no password. */
function refusal(fn: () => unknown): string {
  const error = catchError(fn);
  expect(error).toBeInstanceOf(ConfigError);
  expect((error as ConfigError).exitCode).toBe(2);
  const message = (error as ConfigError).message;
  expect(message).not.toContain(SECRET);
  expect(message).not.toContain('\n');
  return message;
}

function configFile(content: object): string {
  const path = join(folder, `config-${files++}.yaml`);
  writeFileSync(path, stringify(content));
  return path;
}

describe('--target rabbitmq-stream:// with --target-stream', () => {
  it('resolves to one URL, the stream, no exchange, queue or routing key, and a stream scope', () => {
    const settings = resolveBridgeSettings(base(), 'run');
    expect(settings.targetUrls).toEqual([STREAM_URL]);
    expect(settings.targetUrl).toBe(STREAM_URL);
    expect(settings.targetStream).toBe('orders-stream');
    expect(settings.targetProducer).toBeUndefined();
    expect(settings.targetExchange).toBe('');
    expect(settings.targetQueue).toBeUndefined();
    expect(settings.targetRoutingKey).toBeUndefined();
    expect(settings.targetUser).toBe('bridge');
    expect(settings.scope).toBe('stream:orders-stream');
    expect(settings.tls.target).toEqual({});
  });

  it('takes the user decoded, guest when the URL names none, and a --scope of its own', () => {
    expect(resolveBridgeSettings(base({ target: 'rabbitmq-stream://host' }), 'run').targetUser).toBe('guest');
    const encoded = resolveBridgeSettings(
      base({ target: `rabbitmq-stream://br%40dge:${SECRET}@host/`, scope: 'mine' }),
      'migrate',
    );
    expect(encoded.targetUser).toBe('br@dge');
    expect(encoded.scope).toBe('mine');
  });

  it('--target-producer names the producer: at most 255 bytes, not empty', () => {
    const settings = resolveBridgeSettings(base({ targetProducer: 'orders-bridge' }), 'run');
    expect(settings.targetProducer).toBe('orders-bridge');
    expect(
      resolveBridgeSettings(base({ targetProducer: 'é'.repeat(127) }), 'run').targetProducer,
    ).toHaveLength(127);
    expect(refusal(() => resolveBridgeSettings(base({ targetProducer: 'é'.repeat(128) }), 'run'))).toBe(
      '--target-producer (or DEDUP_BRIDGE_TARGET_PRODUCER): is longer than 255 bytes',
    );
    expect(refusal(() => resolveBridgeSettings(base({ targetProducer: '' }), 'run'))).toBe(
      '--target-producer (or DEDUP_BRIDGE_TARGET_PRODUCER): must not be empty',
    );
  });

  it('a stream URL without --target-stream is refused, saying what to add', () => {
    expect(refusal(() => resolveBridgeSettings(base({ targetStream: undefined }), 'run'))).toBe(
      '--target-stream (or DEDUP_BRIDGE_TARGET_STREAM): a stream target (rabbitmq-stream://) needs --target-stream <name>, the stream to write to',
    );
  });

  it('--target-stream or --target-producer with an amqp:// target is refused', () => {
    const amqp = { target: `amqp://bridge:${SECRET}@new:5672`, targetQueue: 'orders' };
    expect(refusal(() => resolveBridgeSettings(base(amqp), 'run'))).toMatch(
      /^--target-stream \(or DEDUP_BRIDGE_TARGET_STREAM\): goes with a stream target, --target rabbitmq-stream:\/\/… \(or rabbitmq-stream\+tls:\/\/\); with an amqp:\/\/ target give --target-queue or --target-exchange$/,
    );
    expect(
      refusal(() =>
        resolveBridgeSettings(base({ ...amqp, targetStream: undefined, targetProducer: 'p' }), 'run'),
      ),
    ).toMatch(/^--target-producer \(or DEDUP_BRIDGE_TARGET_PRODUCER\): goes with a stream target/);
  });

  it.each([
    ['targetQueue', '--target-queue'],
    ['targetExchange', '--target-exchange'],
    ['targetRoutingKey', '--target-routing-key'],
  ] as const)('%s beside a stream target is refused, naming %s', (option, flag) => {
    expect(refusal(() => resolveBridgeSettings(base({ [option]: 'x' }), 'run'))).toBe(
      `${flag}: does not go with a stream target (rabbitmq-stream://); --target-stream names the stream to write to`,
    );
  });

  it.each([
    [`rabbitmq-stream://bridge:${SECRET}@:5552/`, /is not a URL|has no host/],
    [
      `rabbitmq-stream+ssl://bridge:${SECRET}@host/`,
      /the scheme must be rabbitmq-stream:\/\/ or rabbitmq-stream\+tls:\/\//,
    ],
    [
      `rabbitmq-stream://bridge:${SECRET}@host/prod?heartbeat=5`,
      /query parameters and fragments are not supported/,
    ],
    [`rabbitmq-stream://bridge:${SECRET}@host/a/b`, /a vhost with a '\/' in it is written %2F/],
    [`rabbitmq-stream://bridge:${SECRET}%zz@host/`, /its password is not valid percent-encoding/],
    [`rabbitmq-stream://bridge:${SECRET}@host:99999/`, /is not a URL/],
  ])('a malformed stream URL %#: the parser’s line, after --target, password masked', (url, pattern) => {
    const message = refusal(() => resolveBridgeSettings(base({ target: url }), 'run'));
    expect(message).toMatch(/^--target \(or DEDUP_BRIDGE_TARGET\): stream URL /);
    expect(message).toMatch(pattern);
  });

  it('a comma-separated list with a stream URL in it is refused: one stream URL for now', () => {
    const message = refusal(() =>
      resolveBridgeSettings(base({ target: `${STREAM_URL},rabbitmq-stream://other:5552/prod` }), 'run'),
    );
    expect(message).toBe(
      '--target (or DEDUP_BRIDGE_TARGET): a stream target is one rabbitmq-stream:// URL; a list of 2 URLs is not supported for a stream (yet): give one node',
    );
  });

  it('a stream source: --source rabbitmq-stream:// with --source-stream; the ID is the offset and park is refused', () => {
    const source = `rabbitmq-stream://bridge:${SECRET}@old:5552/`;
    const settings = resolveBridgeSettings(
      base({ source, sourceQueue: undefined, sourceStream: 'events', sourceStart: '2026-12-01T00:00:00Z' }),
      'run',
    );
    expect(settings).toMatchObject({
      sourceStream: 'events',
      sourceQueue: 'events',
      sourceStart: { timestamp: BigInt(Date.parse('2026-12-01T00:00:00Z')) },
      idFrom: [{ kind: 'offset' }],
    });
    expect(refusal(() => resolveBridgeSettings(base({ source, sourceQueue: undefined }), 'run'))).toBe(
      '--source-stream (or DEDUP_BRIDGE_SOURCE_STREAM): a stream source (rabbitmq-stream://) needs --source-stream <name>, the stream to read',
    );
    expect(refusal(() => resolveBridgeSettings(base({ source }), 'run'))).toMatch(
      /^--source-queue \(or DEDUP_BRIDGE_SOURCE_QUEUE\): does not go with a stream source/,
    );
    expect(
      refusal(() =>
        resolveBridgeSettings(
          base({ source, sourceQueue: undefined, sourceStream: 'events', sourceStart: 'yesterday' }),
          'run',
        ),
      ),
    ).toMatch(/^--source-start \(or DEDUP_BRIDGE_SOURCE_START\): "yesterday" is not a start/);
    expect(
      refusal(() =>
        resolveBridgeSettings(
          base({ source, sourceQueue: undefined, sourceStream: 'events', onUnforwardable: 'dead-letter' }),
          'run',
        ),
      ),
    ).toMatch(/dead-letter is not for a stream source/);
    expect(refusal(() => resolveBridgeSettings(base({ idFrom: 'offset' }), 'run'))).toMatch(
      /^--id-from: offset is a stream message's position and goes with a stream source/,
    );
    expect(refusal(() => resolveBridgeSettings(base({ sourceStart: 'first' }), 'run'))).toMatch(
      /^--source-start \(or DEDUP_BRIDGE_SOURCE_START\): goes with a stream source/,
    );
  });

  it('a stream name with braces or spaces needs a --scope', () => {
    expect(refusal(() => resolveBridgeSettings(base({ targetStream: 'a {b}' }), 'run'))).toMatch(
      /^--scope: /,
    );
  });

  it('rabbitmq-stream+tls:// takes --target-ca/--target-cert/--target-key; plain rabbitmq-stream:// refuses them', () => {
    const certs = makeCertificates(join(folder, 'certs'));
    const tls = `rabbitmq-stream+tls://bridge:${SECRET}@streams.example/prod`;
    const settings = resolveBridgeSettings(
      base({ target: tls, targetCa: certs.ca, targetCert: certs.clientCert, targetKey: certs.clientKey }),
      'run',
    );
    expect(settings.tls.target).toEqual({ ca: certs.ca, cert: certs.clientCert, key: certs.clientKey });
    expect(refusal(() => resolveBridgeSettings(base({ targetCa: certs.ca }), 'run'))).toBe(
      '--target-ca: needs --target to be rabbitmq-stream+tls://, not rabbitmq-stream://; use rabbitmq-stream+tls:// (with TLS options the bridge never connects plain)',
    );
  });
});

describe('a stream URL is masked wherever a target URL is shown', () => {
  it.each([
    `rabbitmq-stream://bridge:${SECRET}@host:5552/prod`,
    `rabbitmq-stream+tls://bridge:${SECRET}@host/prod`,
    `rabbitmq-stream://bridge:${SECRET}/x@host:5552/prod`,
    `rabbitmq-stream://bridge:${SECRET}?x@host/`,
    `rabbitmq-stream://bridge:${SECRET}@host:5552/prod?password=${SECRET}`,
  ])('redactUrl(%j) shows no password', (url) => {
    const shown = redactUrl(url);
    expect(shown).not.toContain(SECRET);
    expect(shown).toContain('***');
    expect(shown).toMatch(/^rabbitmq-stream(\+tls)?:\/\/bridge:\*\*\*@/);
  });
});

describe('migrate to a stream', () => {
  const migrate = { ...base(), sourceQueue: ['orders'] };

  it('moves one source queue into the stream --target-stream names', () => {
    const settings = resolveMigrateSettings({ ...migrate, declareTarget: true });
    expect(settings.routes).toHaveLength(1);
    const route = settings.routes[0];
    expect(route?.targetStream).toBe('orders-stream');
    expect(route?.targetQueue).toBeUndefined();
    expect(route?.scope).toBe('stream:orders-stream');
    // --declare-target creates the stream over the stream protocol: no management API needed.
    expect(settings.declareTarget).toBe(true);
    expect(settings.jobName).toMatch(/^migrate-[0-9a-f]{12}$/);
  });

  it('refuses several source queues, --map and --target-queue with a stream target', () => {
    expect(refusal(() => resolveMigrateSettings({ ...migrate, sourceQueue: ['a', 'b'] }))).toBe(
      '--source-queue: with a stream target (rabbitmq-stream://) a migrate moves exactly one source queue, into the stream --target-stream names; 2 are listed: run one migrate per queue',
    );
    expect(refusal(() => resolveMigrateSettings({ ...migrate, map: ['orders=x'] }))).toBe(
      '--map: does not go with a stream target (rabbitmq-stream://); --target-stream names the stream',
    );
    expect(refusal(() => resolveMigrateSettings({ ...migrate, targetQueue: 'x' }))).toMatch(
      /^--target-queue: does not go with a stream target/,
    );
    expect(refusal(() => resolveMigrateSettings({ ...migrate, targetStream: undefined }))).toMatch(
      /^--target-stream \(or DEDUP_BRIDGE_TARGET_STREAM\): a stream target/,
    );
  });

  it('a job file may name a stream URL (also as { env }), not a target per queue', () => {
    process.env.DEDUP_TEST_STREAM_URL = STREAM_URL;
    const good = configFile({ target: { env: 'DEDUP_TEST_STREAM_URL' }, queues: ['orders'] });
    const { target: _target, ...flags } = migrate;
    const settings = resolveMigrateSettings({ ...flags, sourceQueue: undefined, jobFile: good });
    expect(settings.routes[0]?.targetUrl).toBe(STREAM_URL);
    const mapped = configFile({ target: STREAM_URL, queues: [{ source: 'orders', target: 'other' }] });
    expect(refusal(() => resolveMigrateSettings({ ...flags, sourceQueue: undefined, jobFile: mapped }))).toBe(
      `--job-file ${mapped}: queues[0].target: does not go with a stream target (rabbitmq-stream://); --target-stream names the stream`,
    );
  });

  afterEach(() => {
    delete process.env.DEDUP_TEST_STREAM_URL;
  });
});

describe('a config file with a stream target', () => {
  function streamFile(target: Record<string, unknown>, url: unknown = STREAM_URL) {
    return {
      brokers: { old: { url: `amqp://bridge:${SECRET}@old:5672` }, streams: { url } },
      routes: [{ name: 'orders', source: { broker: 'old', queue: 'orders' }, target }],
    };
  }

  function loadError(content: object, flags: RawOptions = {}): string {
    const path = configFile(content);
    return refusal(() => loadConfigRoutes(path, flags, 'run')).replace(`${path}: `, '');
  }

  it('takes target.stream and target.producer on a rabbitmq-stream:// broker, the URL also as { file }', () => {
    const secretFile = join(folder, 'stream-url');
    writeFileSync(secretFile, `${STREAM_URL}\n`);
    const path = configFile(
      streamFile({ broker: 'streams', stream: 'orders-stream', producer: 'p1' }, { file: secretFile }),
    );
    const [route] = loadConfigRoutes(path, {}, 'run');
    expect(route?.targetUrls).toEqual([STREAM_URL]);
    expect(route?.targetStream).toBe('orders-stream');
    expect(route?.targetProducer).toBe('p1');
    expect(route?.scope).toBe('stream:orders-stream');
    const shown = stringify(describeConfig(loadConfigFile(path), loadConfigRoutes(path, {}, 'run')));
    expect(shown).not.toContain(SECRET);
    expect(shown).toContain('rabbitmq-stream://bridge:***@streams.example:5552/prod');
    expect(shown).toContain('stream: orders-stream');
    expect(shown).not.toContain('exchange:');
  });

  it('--target-stream over a one-route file replaces its target choice', () => {
    const path = configFile(streamFile({ broker: 'streams', stream: 'orders-stream', producer: 'p1' }));
    const [route] = loadConfigRoutes(path, { targetStream: 'other' }, 'run');
    expect(route?.targetStream).toBe('other');
    expect(route?.targetProducer).toBeUndefined();
  });

  it('refuses a stream broker without target.stream, target.stream on an AMQP broker, and a queue beside it', () => {
    expect(loadError(streamFile({ broker: 'streams' }))).toBe(
      'routes[0].target.stream: broker "streams" is a stream endpoint (rabbitmq-stream://): name the stream to write to',
    );
    expect(loadError(streamFile({ broker: 'old', stream: 's' }))).toBe(
      'routes[0].target.stream: goes with a broker whose url is rabbitmq-stream:// (or rabbitmq-stream+tls://); broker "old" is not one',
    );
    expect(loadError(streamFile({ broker: 'streams', stream: 's', queue: 'q' }))).toBe(
      'routes[0].target.queue: does not go with a stream target; target.stream names the stream',
    );
    expect(loadError(streamFile({ broker: 'old', queue: 'q', producer: 'p' }))).toBe(
      'routes[0].target.producer: goes with target.stream (a stream target)',
    );
  });

  it('a stream broker as a source reads a stream, not a queue; a malformed stream URL is refused, passwords masked', () => {
    const file = streamFile({ broker: 'old', queue: 'q' });
    const asSource = { ...file, routes: [{ ...file.routes[0], source: { broker: 'streams', queue: 'q' } }] };
    expect(loadError(asSource)).toMatch(
      /^routes\[0\]\.source\.queue: does not go with a stream source; source\.stream names the stream to read/,
    );
    expect(
      loadError(
        streamFile({ broker: 'streams', stream: 's' }, `rabbitmq-stream://bridge:${SECRET}@host/a/b`),
      ),
    ).toMatch(/^brokers\.streams\.url: stream URL rabbitmq-stream:\/\/bridge:\*\*\*@host\/a\/b: a vhost/);
  });
});

describe('the CLI options', () => {
  it('--target-stream and --target-producer are flags and variables of run and migrate', () => {
    for (const mode of ['run', 'migrate'] as const) {
      const command = addBridgeOptions(new Command(mode).exitOverride(), mode);
      const env = { DEDUP_BRIDGE_TARGET_STREAM: 'from-env', DEDUP_BRIDGE_TARGET_PRODUCER: 'producer-env' };
      const saved = { ...process.env };
      Object.assign(process.env, env);
      try {
        command.parse(['--target-stream', 'from-flag'], { from: 'user' });
      } finally {
        process.env = saved;
      }
      expect(command.opts().targetStream).toBe('from-flag');
      expect(command.opts().targetProducer).toBe('producer-env');
    }
  });
});
