import amqp from 'amqplib';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  countDelivery,
  declareQueue,
  depthOf,
  idText,
  openBroker,
  publishAll,
  runCli,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
} from '../helpers.js';
import { type AdminServers, adminServers, asUser, type Permissions, redisAdmin } from './privilege-admin.js';

// The Redis ACL of docs/security.md, "Least privilege", for the key prefix `${prefix}`.
const redisAcl = (prefix: string) => [
  `~${prefix}:*`,
  'resetchannels',
  '-@all',
  '+@read',
  '+@write',
  '+@scripting',
  '-@dangerous',
  '+info',
  '+time',
  '+client|setname',
];

const PASSWORD = 'least-privilege';

/** Messages with IDs `<prefix>-<i>`, published to `routingKey` through `exchange` on the source. */
function messages(prefix: string, count: number, exchange = '', routingKey?: string) {
  return Array.from({ length: count }, (_, i) => ({
    body: `${prefix} ${i}`,
    options: { headers: { _HQ_DUPL_ID: `${prefix}-${i}` } },
    exchange,
    routingKey,
  }));
}

const idsOf = (received: { properties: { headers?: Record<string, unknown> } }[]) =>
  received.map((message) => idText(message.properties.headers?._HQ_DUPL_ID));

describe('least privilege: the bridge runs as users with only the documented permissions', () => {
  let admin: AdminServers;
  const name = uniqueName('priv');
  // Queues, exchange and users of this file share the name, so the permission regexes are short.
  const migrated = `${name}-migrated`;
  const live = `${name}-live`;
  const liveTarget = `${name}-live-dst`;
  const park = `${name}-park`;
  const exchange = `${name}-x`;
  const refusedQueue = `${name}-refused`;
  const sourceUser = `${name}-source`;
  const targetUser = `${name}-target`;
  const noWriteUser = `${name}-no-write`;
  const redisUser = `${name}-redis`;
  const noScriptsUser = `${name}-redis-no-scripts`;

  // docs/security.md, "Least privilege": the base grants plus those of the options the tests use.
  const sourcePermissions: Permissions = {
    configure: `^${migrated}$`, // migrate --delete-source-when-empty
    write: '^amq\\.default$', // --park-queue
    read: `^${name}-(migrated|live|refused)$`, // the source queues
  };
  const targetPermissions: Permissions = {
    configure: `^${migrated}$`, // migrate --declare-target
    write: `^(amq\\.default|${exchange})$`, // --target-queue / --target-exchange
    read: '^$',
  };

  beforeAll(async () => {
    admin = await adminServers();
    await Promise.all([
      admin.addUsers('source', [
        { name: sourceUser, password: PASSWORD, permissions: sourcePermissions, tags: 'management' },
      ]),
      admin.addUsers('target', [
        { name: targetUser, password: PASSWORD, permissions: targetPermissions },
        { name: noWriteUser, password: PASSWORD, permissions: { ...targetPermissions, write: '^$' } },
      ]),
      redisAdmin(admin.redisUrl, 'ACL', 'SETUSER', redisUser, 'on', `>${PASSWORD}`, ...redisAcl(name)),
      redisAdmin(
        admin.redisUrl,
        'ACL',
        'SETUSER',
        noScriptsUser,
        'on',
        `>${PASSWORD}`,
        ...redisAcl(name).filter((rule) => rule !== '+@scripting'),
      ),
    ]);
  });

  afterAll(async () => {
    if (!admin) return;
    await Promise.allSettled([
      admin.deleteUsers('source', [sourceUser]),
      admin.deleteUsers('target', [targetUser, noWriteUser]),
      redisAdmin(admin.redisUrl, 'ACL', 'DELUSER', redisUser, noScriptsUser),
    ]);
    await admin.stop();
  });

  /** Common flags, as restricted users: the source, target and Redis URLs and the key prefix. */
  function connection(users: { target?: string; redis?: string } = {}): string[] {
    return [
      '--source',
      asUser(admin.sourceUrl, sourceUser, PASSWORD),
      '--target',
      asUser(admin.targetUrl, users.target ?? targetUser, PASSWORD),
      '--redis',
      asUser(admin.redisUrl, users.redis ?? redisUser, PASSWORD),
      '--redis-prefix',
      name,
    ];
  }

  it('migrate (declaring the target, deleting the drained source) and run (parking) forward each message once', async () => {
    // migrate: the target queue does not exist yet; the source queue is deleted once drained.
    await declareQueue(admin.sourceUrl, migrated);
    await publishAll(admin.sourceUrl, migrated, messages(migrated, 20));
    const migrate = await runCli([
      'migrate',
      ...connection(),
      '--source-queue',
      migrated,
      '--declare-target',
      '--delete-source-when-empty',
      '--source-management',
      asUser(admin.sourceManagementUrl, sourceUser, PASSWORD),
      '--idle-timeout',
      '300ms',
      '--quiet',
    ]);
    expect(migrate.stderr).toBe('');
    expect(migrate.code).toBe(0);
    const migratedCount = countDelivery(
      'privilege migrate',
      messages(migrated, 20).map((message) => message.options.headers._HQ_DUPL_ID),
      idsOf(await takeAll(admin.targetUrl, migrated)),
    );
    expect(migratedCount).toMatchObject({ received: 20, lost: 0, duplicated: 0, unexpected: 0 });
    const probe = await amqp.connect(admin.sourceUrl);
    probe.on('error', () => {});
    const channel = await probe.createChannel();
    channel.on('error', () => {});
    await expect(channel.checkQueue(migrated)).rejects.toThrow(/404/);
    await probe.close().catch(() => {});

    // run: through a target exchange; what it cannot route goes to the park queue on the source.
    await declareQueue(admin.sourceUrl, live);
    await declareQueue(admin.sourceUrl, park);
    await declareQueue(admin.targetUrl, liveTarget);
    const target = await openBroker(admin.targetUrl);
    await target.channel.assertExchange(exchange, 'direct', { durable: true });
    await target.channel.bindQueue(liveTarget, exchange, 'routed');
    await target.close();
    // Published through amq.direct so that each message keeps its routing key on the way.
    const source = await openBroker(admin.sourceUrl);
    for (const key of ['routed', 'nowhere']) await source.channel.bindQueue(live, 'amq.direct', key);
    await source.close();
    const routed = messages(`${live}-routed`, 12, 'amq.direct', 'routed');
    const unroutable = messages(`${live}-nowhere`, 3, 'amq.direct', 'nowhere');
    await publishAll(admin.sourceUrl, live, [...routed, ...unroutable]);

    const run = startCli([
      'run',
      ...connection(),
      '--source-queue',
      live,
      '--target-exchange',
      exchange,
      '--park-queue',
      park,
    ]);
    const settled = await waitFor(
      async () =>
        (await depthOf(admin.targetUrl, liveTarget)) === 12 && (await depthOf(admin.sourceUrl, park)) === 3,
      30_000,
    );
    run.signal('SIGTERM');
    const stopped = await run.done;
    expect(settled, stopped.stderr + stopped.stdout.slice(-2000)).toBe(true);
    expect(stopped.code).toBe(0);
    const ids = (list: typeof routed) => list.map((message) => message.options.headers._HQ_DUPL_ID);
    const forwarded = countDelivery(
      'privilege run',
      ids(routed),
      idsOf(await takeAll(admin.targetUrl, liveTarget)),
    );
    expect(forwarded).toMatchObject({ received: 12, lost: 0, duplicated: 0, unexpected: 0 });
    const parked = await takeAll(admin.sourceUrl, park);
    expect(parked.map((message) => message.properties.headers?._HQ_DUPL_ID).sort()).toEqual(
      ids(unroutable).sort(),
    );
    expect(await depthOf(admin.sourceUrl, live)).toBe(0);

    // The cache tools work with the same Redis ACL.
    const redis = asUser(admin.redisUrl, redisUser, PASSWORD);
    const inspect = await runCli([
      'inspect',
      '--redis',
      redis,
      '--redis-prefix',
      name,
      '--scope',
      `exchange:${exchange}`,
      `${live}-routed-0`,
    ]);
    expect(inspect.stdout).toMatch(/committed/);
    const stats = await runCli([
      'cache',
      'stats',
      '--redis',
      redis,
      '--redis-prefix',
      name,
      '--scope',
      `queue:${migrated}`,
    ]);
    expect(stats.stdout).toMatch(/20 committed IDs/);
  });

  it('one permission less stops at once, naming it (exit 2), and moves nothing', async () => {
    await declareQueue(admin.sourceUrl, refusedQueue);
    await declareQueue(admin.targetUrl, refusedQueue);
    await publishAll(admin.sourceUrl, refusedQueue, messages(refusedQueue, 3));
    const migrate = (users: { target?: string; redis?: string }) =>
      runCli([
        'migrate',
        ...connection(users),
        '--source-queue',
        refusedQueue,
        '--idle-timeout',
        '300ms',
        '--quiet',
      ]);

    // No write permission on the target's default exchange.
    const noWrite = await migrate({ target: noWriteUser });
    expect(noWrite.code).toBe(2);
    expect(noWrite.stderr).toBe(
      `dedup-bridge: target broker at ${asUser(admin.targetUrl, noWriteUser, '***')}: access to exchange 'amq.default' in vhost '/' refused for user '${noWriteUser}'; grant the user write permission on it\n`,
    );

    // A Redis user without the scripting commands.
    const noScripts = await migrate({ redis: noScriptsUser });
    expect(noScripts.code).toBe(2);
    expect(noScripts.stderr).toMatch(
      /^dedup-bridge: Redis refused the claim call \(NOPERM [^\n]*'eval(sha)?' command\); give the user the ACL that docs\/security\.md, Least privilege, lists\n$/,
    );

    expect(await depthOf(admin.sourceUrl, refusedQueue)).toBe(3);
    expect(await depthOf(admin.targetUrl, refusedQueue)).toBe(0);
  });
});
