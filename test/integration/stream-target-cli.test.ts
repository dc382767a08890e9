import { rmSync } from 'node:fs';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { StreamClient } from '../../src/stream/client.js';
import { freePort, newRunDir, RabbitNode } from '../harness/servers.js';
import { type CliResult, queuePair, runCli, servers, uniqueName } from '../helpers.js';

// The CLI with a stream target (issue 30), on a node of its own with the stream plugin: refusals
// are one line, exit 2, no password; migrate checks the stream before anything moves, and
// --declare-target creates it over the stream protocol.

const SECRET = 'Str3am-s3cr3t-Pa55';
let runDir = '';
let node: RabbitNode;
let streamPort = 0;

function streamUrl(password = SECRET): string {
  return `rabbitmq-stream://bridge:${password}@127.0.0.1:${streamPort}/`;
}

/** One line on stderr, no stack trace, the password nowhere. */
function expectOneLine(result: CliResult, code: number, pattern: RegExp): void {
  const lines = result.stderr.trim().split('\n');
  expect(lines, result.stderr).toHaveLength(1);
  expect(lines[0]).toMatch(/^dedup-bridge: /);
  expect(lines[0]).toMatch(pattern);
  expect(result.stderr).not.toMatch(/\n\s+at /);
  expect(result.stdout + result.stderr).not.toContain(SECRET);
  expect(result.code).toBe(code);
}

async function streamExists(name: string): Promise<boolean> {
  const client = await StreamClient.connect({ url: streamUrl() });
  try {
    const [found] = await client.metadata([name]);
    return found?.codeName === 'OK';
  } finally {
    await client.close();
  }
}

beforeAll(async () => {
  runDir = newRunDir();
  streamPort = await freePort();
  node = new RabbitNode(runDir, 'stream-cli', {
    plugins: ['rabbitmq_stream'],
    config: [`stream.listeners.tcp.1 = ${streamPort}`],
  });
  await node.start();
  await node.ctl('add_user', 'bridge', SECRET);
  await node.ctl('set_permissions', '-p', '/', 'bridge', '.*', '.*', '.*');
}, 180_000);

afterAll(async () => {
  await node?.stop();
  if (runDir) rmSync(runDir, { recursive: true, force: true });
});

describe('a stream target on the command line', () => {
  it('a stream URL without --target-stream exits 2 with one line, password masked', async () => {
    const { sourceUrl, redisUrl } = servers();
    const result = await runCli(
      ['migrate', '--source', sourceUrl, '--source-queue', 'x', '--redis', redisUrl],
      { env: { DEDUP_BRIDGE_TARGET: streamUrl() } },
    );
    expectOneLine(
      result,
      2,
      /^dedup-bridge: --target-stream \(or DEDUP_BRIDGE_TARGET_STREAM\): a stream target \(rabbitmq-stream:\/\/\) needs --target-stream <name>, the stream to write to$/,
    );
  });

  it('a stream URL as --source with --source-queue, and --target-stream from its variable with an amqp:// target, exit 2', async () => {
    const { sourceUrl, targetUrl, redisUrl } = servers();
    const source = await runCli([
      'run',
      '--source',
      streamUrl(),
      '--source-queue',
      'x',
      '--target',
      targetUrl,
      '--target-queue',
      'y',
      '--redis',
      redisUrl,
    ]);
    expectOneLine(
      source,
      2,
      /--source-queue \(or DEDUP_BRIDGE_SOURCE_QUEUE\): does not go with a stream source \(rabbitmq-stream:\/\/\); --source-stream names the stream to read/,
    );
    const stream = await runCli(
      ['run', '--source', sourceUrl, '--source-queue', 'x', '--target', targetUrl, '--redis', redisUrl],
      { env: { DEDUP_BRIDGE_TARGET_STREAM: 'orders' } },
    );
    expectOneLine(
      stream,
      2,
      /^dedup-bridge: DEDUP_BRIDGE_TARGET_STREAM \(--target-stream\): goes with a stream target/,
    );
  });

  it('migrate to a stream that does not exist exits 2 naming it; --declare-target creates it', async () => {
    const { sourceUrl, redisUrl } = servers();
    const { source } = await queuePair();
    const stream = uniqueName('stream');
    const args = ['migrate', '--source', sourceUrl, '--source-queue', source, '--target-stream', stream];
    const env = { DEDUP_BRIDGE_TARGET: streamUrl(), DEDUP_BRIDGE_REDIS: redisUrl };
    const missing = await runCli(args, { env });
    expectOneLine(
      missing,
      2,
      new RegExp(
        `^dedup-bridge: --target-stream: stream "${stream}" does not exist on the target stream endpoint at rabbitmq-stream://bridge:\\*\\*\\*@127\\.0\\.0\\.1:${streamPort}/; create it first \\(migrate --declare-target creates it\\), or fix the name$`,
      ),
    );
    expect(await streamExists(stream)).toBe(false);
    // A dry run moves nothing, but the checks and --declare-target before it run in full.
    const declared = await runCli([...args, '--declare-target', '--dry-run', '--quiet'], { env });
    expect(declared.stdout + declared.stderr).not.toContain(SECRET);
    expect(declared.code, declared.stderr).toBe(0);
    expect(await streamExists(stream)).toBe(true);
    // Once more: the stream exists, and is left as it is.
    const again = await runCli([...args, '--declare-target', '--dry-run', '--quiet'], { env });
    expect(again.code, again.stderr).toBe(0);
  });

  it('a wrong password on the stream endpoint exits 2 at the check, without printing it', async () => {
    const { sourceUrl, redisUrl } = servers();
    const { source } = await queuePair();
    const wrong = `${SECRET}-wrong`;
    const result = await runCli(
      ['migrate', '--source', sourceUrl, '--source-queue', source, '--target-stream', 's'],
      { env: { DEDUP_BRIDGE_TARGET: streamUrl(wrong), DEDUP_BRIDGE_REDIS: redisUrl } },
    );
    expectOneLine(
      result,
      2,
      /target stream endpoint at rabbitmq-stream:\/\/bridge:\*\*\*@.* refused us: .*AUTHENTICATION_FAILURE/,
    );
  });
});
