import amqp from 'amqplib';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createIdempotentConsumer } from '../../src/client/consumer.js';
import {
  documentedAcl,
  documentedPermissions,
  forTest,
  notRefused,
  refusalsOf,
} from '../documented-grants.js';
import {
  declareQueue,
  delivered,
  depthOf,
  numbered,
  openBroker,
  publishAll,
  runCli,
  startCli,
  takeAll,
  uniqueName,
  waitFor,
} from '../helpers.js';
import { type AdminServers, adminServers, asUser, type Permissions, redisAdmin } from './privilege-admin.js';

/** The Redis users of the docs' "Redis ACL" lines, for this file's key prefix. */
const bridgeAcl = () => documentedAcl('the bridge: run');
const dbAcl = () => documentedAcl('database other than 0');
const toolsAcl = () => documentedAcl('cache stats and cache reset-scope');

const PASSWORD = 'least-privilege';

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
  const noSetUser = `${name}-redis-no-set`;
  const toolsUser = `${name}-redis-tools`;
  const dbUser = `${name}-redis-db`;

  /** Creates a Redis user from documented lines, run in order as the docs say. */
  const setRedisUser = async (user: string, lines: { rules: string[] }[]) => {
    for (const { rules } of lines) {
      await redisAdmin(
        admin.redisUrl,
        'ACL',
        'SETUSER',
        user,
        ...forTest(rules, { password: PASSWORD, prefix: name }),
      );
    }
  };

  // docs/security.md, "Least privilege": the base grants plus those of the options the tests use.
  const sourcePermissions: Permissions = {
    configure: `^${migrated}$`, // migrate --delete-source-when-empty
    write: '^amq\\.default$', // --park-queue
    read: `^${name}-(migrated|live|refused|db|fanout|dlq)$`, // the source queues
  };
  const targetPermissions: Permissions = {
    configure: `^${migrated}$`, // migrate --declare-target
    write: `^(amq\\.default|${exchange})$`, // --target-queue / --target-exchange
    read: '^$',
  };

  // README, "Least privilege": the dedicated exchange, and --declare-target of a queue with a DLX.
  const fanoutSource = `${name}-fanout`;
  const fanoutTarget = `${name}-fanout-dst`;
  const ownExchange = `${name}-in`;
  const dlq = `${name}-dlq`;
  const dlx = `${name}-dlx`;
  const exchangeUser = `${name}-own-exchange`;
  const dlxUser = `${name}-declare-dlx`;
  const dlxNoReadUser = `${name}-declare-dlx-no-read`;
  const dlxNoWriteUser = `${name}-declare-dlx-no-write`;
  const exchangePermissions = documentedPermissions('publishing through its own exchange', {
    'orders-in': ownExchange,
  });
  const dlxPermissions = documentedPermissions('whose dead-letter exchange is', {
    orders: dlq,
    'orders-dlx': dlx,
  });

  beforeAll(async () => {
    admin = await adminServers();
    await Promise.all([
      admin.addUsers('source', [
        { name: sourceUser, password: PASSWORD, permissions: sourcePermissions, tags: 'management' },
      ]),
      admin.addUsers('target', [
        { name: targetUser, password: PASSWORD, permissions: targetPermissions },
        { name: noWriteUser, password: PASSWORD, permissions: { ...targetPermissions, write: '^$' } },
        { name: exchangeUser, password: PASSWORD, permissions: exchangePermissions },
        { name: dlxUser, password: PASSWORD, permissions: dlxPermissions },
        { name: dlxNoReadUser, password: PASSWORD, permissions: { ...dlxPermissions, read: '^$' } },
        {
          name: dlxNoWriteUser,
          password: PASSWORD,
          permissions: { ...dlxPermissions, write: '^amq\\.default$' },
        },
      ]),
      setRedisUser(redisUser, bridgeAcl()),
      setRedisUser(toolsUser, [...bridgeAcl(), ...toolsAcl()]),
      setRedisUser(dbUser, [...bridgeAcl(), ...dbAcl()]),
      setRedisUser(
        noScriptsUser,
        bridgeAcl().map(({ rules }) => ({
          rules: rules.filter((rule) => rule !== '+eval' && rule !== '+evalsha'),
        })),
      ),
      setRedisUser(
        noSetUser,
        bridgeAcl().map(({ rules }) => ({ rules: rules.filter((rule) => rule !== '+set') })),
      ),
    ]);
  });

  afterAll(async () => {
    if (!admin) return;
    await Promise.allSettled([
      admin.deleteUsers('source', [sourceUser]),
      admin.deleteUsers('target', [
        targetUser,
        noWriteUser,
        exchangeUser,
        dlxUser,
        dlxNoReadUser,
        dlxNoWriteUser,
      ]),
      redisAdmin(admin.redisUrl, 'ACL', 'DELUSER', redisUser, noScriptsUser, noSetUser, toolsUser, dbUser),
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
    await publishAll(admin.sourceUrl, migrated, numbered(migrated, 20).messages);
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
    const migratedCount = await delivered(
      'privilege migrate',
      admin.targetUrl,
      migrated,
      numbered(migrated, 20).ids,
    );
    expect(migratedCount.count).toMatchObject({ received: 20, lost: 0, duplicated: 0, unexpected: 0 });
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
    const routed = numbered(`${live}-routed`, 12);
    const unroutable = numbered(`${live}-nowhere`, 3);
    await publishAll(admin.sourceUrl, live, [
      ...routed.messages.map((message) => ({ ...message, exchange: 'amq.direct', routingKey: 'routed' })),
      ...unroutable.messages.map((message) => ({
        ...message,
        exchange: 'amq.direct',
        routingKey: 'nowhere',
      })),
    ]);

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
    const forwarded = await delivered('privilege run', admin.targetUrl, liveTarget, routed.ids);
    expect(forwarded.count).toMatchObject({ received: 12, lost: 0, duplicated: 0, unexpected: 0 });
    const parked = await takeAll(admin.sourceUrl, park);
    expect(parked.map((message) => message.properties.headers?._HQ_DUPL_ID).sort()).toEqual(
      [...unroutable.ids].sort(),
    );
    expect(await depthOf(admin.sourceUrl, live)).toBe(0);

    // The bridge's user needed nothing it was not granted: Redis logged no refusal of it.
    expect(refusalsOf(await redisAdmin(admin.redisUrl, 'ACL', 'LOG', '1000'), redisUser)).toEqual([]);

    // inspect and cache forget work as the bridge's user; cache stats needs SCAN, which it lacks.
    const tool = (user: string, ...args: string[]) =>
      runCli([...args, '--redis', asUser(admin.redisUrl, user, PASSWORD), '--redis-prefix', name]);
    const inspect = await tool(redisUser, 'inspect', '--scope', `exchange:${exchange}`, `${live}-routed-0`);
    expect(inspect.stderr).toBe('');
    expect(inspect.stdout).toMatch(/committed/);
    const forget = await tool(
      redisUser,
      'cache',
      'forget',
      '--scope',
      `exchange:${exchange}`,
      `${live}-routed-0`,
      '--yes',
    );
    expect(forget.stdout).toContain('forgot 1 of 1 ID(s)');
    const mistyped = await tool(redisUser, 'inspect', '--scope', `exchange:${exchange}x`, 'any');
    expect(mistyped.code).toBe(2);
    expect(mistyped.stderr).toBe(
      `dedup-bridge: --scope: no such scope "exchange:${exchange}x" under --redis-prefix "${name}" (this Redis user may not SCAN, so the stored scopes are not listed); check --scope, --redis and --redis-prefix\n`,
    );
    const refusedStats = await tool(redisUser, 'cache', 'stats', '--scope', `queue:${migrated}`);
    expect(refusedStats.code).toBe(2);
    expect(refusedStats.stderr).toMatch(
      /^dedup-bridge: cache stats: Redis refused a command it needs \(NOPERM [^\n]*'scan' command\); give the --redis user the grants that docs\/security\.md, Least privilege, lists for this tool\n$/,
    );
    // The tools' user (the bridge's lines, then the tools' line) reads and resets the scope.
    const stats = await tool(toolsUser, 'cache', 'stats', '--scope', `queue:${migrated}`);
    expect(stats.stderr).toBe('');
    expect(stats.stdout).toMatch(/20 committed IDs/);
    const reset = await tool(
      toolsUser,
      'cache',
      'reset-scope',
      '--scope',
      `queue:${migrated}`,
      '--yes',
      '--force',
    );
    expect(reset.stderr).toBe('');
    expect(reset.stdout).toMatch(/forgot 20 committed ID\(s\)/);
    expect(refusalsOf(await redisAdmin(admin.redisUrl, 'ACL', 'LOG', '1000'), toolsUser)).toEqual([]);

    // What the bridge's user must not do: other applications' functions, listing or counting every
    // key, keys outside its prefix.
    const asBridge = new Redis(asUser(admin.redisUrl, redisUser, PASSWORD));
    try {
      expect(await notRefused((command, ...args) => asBridge.call(command, ...args))).toEqual([]);
    } finally {
      asBridge.disconnect();
    }
  });

  it("on a database other than 0: the bridge's lines plus SELECT forward each message once; without SELECT it stops at once naming it", async () => {
    const queue = `${name}-db`;
    await declareQueue(admin.sourceUrl, queue);
    await declareQueue(admin.targetUrl, queue);
    await publishAll(admin.sourceUrl, queue, numbered(queue, 10).messages);
    const onDb = (user: string) => [
      'migrate',
      '--source',
      asUser(admin.sourceUrl, sourceUser, PASSWORD),
      '--target',
      asUser(admin.targetUrl, targetUser, PASSWORD),
      '--redis',
      `${asUser(admin.redisUrl, user, PASSWORD)}/3`,
      '--redis-prefix',
      name,
      '--source-queue',
      queue,
      '--idle-timeout',
      '300ms',
      '--quiet',
    ];
    const refused = await runCli(onDb(redisUser));
    expect(refused.code).toBe(2);
    expect(refused.stderr).toMatch(
      /^dedup-bridge: Redis at [^\n]*\/3: NOPERM [^\n]*'select' command[^\n]*\n$/,
    );
    expect(refused.stderr).not.toContain(PASSWORD);
    expect(await depthOf(admin.targetUrl, queue)).toBe(0);

    const migrate = await runCli(onDb(dbUser));
    expect(migrate.stderr).toBe('');
    expect(migrate.code).toBe(0);
    const { count } = await delivered('privilege db 3', admin.targetUrl, queue, numbered(queue, 10).ids);
    expect(count).toMatchObject({ received: 10, lost: 0, duplicated: 0, unexpected: 0 });
    expect(refusalsOf(await redisAdmin(admin.redisUrl, 'ACL', 'LOG', '1000'), dbUser)).toEqual([]);
    // The IDs are in database 3, not 0.
    const layout = `${name}:{queue:${queue}}:layout`;
    const db3 = new Redis(`${admin.redisUrl}/3`);
    const db0 = new Redis(admin.redisUrl);
    try {
      expect([await db3.exists(layout), await db0.exists(layout)]).toEqual([1, 0]);
    } finally {
      db3.disconnect();
      db0.disconnect();
    }
    const asBridge = new Redis(`${asUser(admin.redisUrl, dbUser, PASSWORD)}/3`);
    try {
      expect(await notRefused((command, ...args) => asBridge.call(command, ...args))).toEqual([]);
    } finally {
      asBridge.disconnect();
    }
  });

  it("the library's idempotent consumer runs as the documented consumer user: each ID handled once, its writes land, the rest refused", async () => {
    const queue = `${name}-consumer`;
    const scope = `${name}-app`;
    const consumerUser = `${name}-redis-consumer`;
    const [line] = documentedAcl('a library consumer of scope billing');
    await redisAdmin(
      admin.redisUrl,
      'ACL',
      'SETUSER',
      consumerUser,
      ...forTest(line?.rules ?? [], { password: PASSWORD, prefix: name, scope }),
    );
    const redis = new Redis(asUser(admin.redisUrl, consumerUser, PASSWORD));
    const broker = await openBroker(admin.sourceUrl);
    try {
      await declareQueue(admin.sourceUrl, queue);
      const { messages: sent } = numbered(queue, 10);
      await publishAll(admin.sourceUrl, queue, [...sent, ...sent.slice(0, 3)]);
      const revenue = `{${scope}}:revenue`;
      const consumer = await createIdempotentConsumer({
        channel: broker.channel,
        queue,
        redis,
        scope,
        prefix: name,
        handler: (_message, context) => {
          context.transaction().hincrby(revenue, 'total', 1);
        },
      });
      expect(await waitFor(() => consumer.counts.processed + consumer.counts.duplicates === 13)).toBe(true);
      await consumer.stop();
      expect(consumer.counts).toMatchObject({ processed: 10, duplicates: 3, failures: 0 });
      expect(await redisAdmin(admin.redisUrl, 'HGET', revenue, 'total')).toBe('10');
      expect(refusalsOf(await redisAdmin(admin.redisUrl, 'ACL', 'LOG', '1000'), consumerUser)).toEqual([]);
      expect(await notRefused((command, ...args) => redis.call(command, ...args))).toEqual([]);
    } finally {
      await broker.close();
      redis.disconnect();
      await redisAdmin(admin.redisUrl, 'ACL', 'DELUSER', consumerUser);
    }
  });

  it('through an exchange of its own, the target user forwards each message once and may publish nowhere else', async () => {
    await declareQueue(admin.sourceUrl, fanoutSource);
    await declareQueue(admin.targetUrl, fanoutTarget);
    await declareQueue(admin.targetUrl, refusedQueue);
    // The administrator's part: the exchange, bound to the target queue only.
    const setup = await openBroker(admin.targetUrl);
    await setup.channel.assertExchange(ownExchange, 'fanout', { durable: true });
    await setup.channel.bindQueue(fanoutTarget, ownExchange, '');
    await setup.close();
    const sent = numbered(fanoutSource, 10);
    await publishAll(admin.sourceUrl, fanoutSource, sent.messages);
    const migrate = await runCli([
      'migrate',
      ...connection({ target: exchangeUser }),
      '--source-queue',
      fanoutSource,
      '--target-exchange',
      ownExchange,
      '--idle-timeout',
      '300ms',
      '--quiet',
    ]);
    expect(migrate.stderr).toBe('');
    expect(migrate.code).toBe(0);
    const { count } = await delivered('privilege own exchange', admin.targetUrl, fanoutTarget, sent.ids);
    expect(count).toMatchObject({ received: 10, lost: 0, duplicated: 0, unexpected: 0 });

    // The same user publishing to another queue: through the default exchange or another one.
    const refusals: string[] = [];
    for (const exchange of ['', 'amq.direct', 'amq.fanout']) {
      const broker = await openBroker(asUser(admin.targetUrl, exchangeUser, PASSWORD));
      const closed = new Promise<string>((resolve) =>
        broker.channel.on('error', (error: Error) => resolve(error.message)),
      );
      broker.channel.publish(exchange, refusedQueue, Buffer.from('not for this user'));
      refusals.push(await closed);
      await broker.close();
    }
    expect(refusals).toEqual(
      ['amq.default', 'amq.direct', 'amq.fanout'].map((exchange) =>
        expect.stringContaining(
          `ACCESS_REFUSED - access to exchange '${exchange}' in vhost '/' refused for user '${exchangeUser}'`,
        ),
      ),
    );
    // Nor may it bind another queue to its exchange.
    const binder = await openBroker(asUser(admin.targetUrl, exchangeUser, PASSWORD));
    const bindRefused = new Promise<string>((resolve) =>
      binder.channel.on('error', (error: Error) => resolve(error.message)),
    );
    await binder.channel.bindQueue(refusedQueue, ownExchange, '').catch(() => {});
    expect(await bindRefused).toContain(
      `ACCESS_REFUSED - access to queue '${refusedQueue}' in vhost '/' refused for user '${exchangeUser}'`,
    );
    await binder.close();
    expect(await depthOf(admin.targetUrl, refusedQueue)).toBe(0);
  });

  it('--declare-target of a queue with a dead-letter exchange works with the documented grant, and names what is missing without it', async () => {
    const source = await openBroker(admin.sourceUrl);
    await source.channel.assertQueue(dlq, { durable: true, arguments: { 'x-dead-letter-exchange': dlx } });
    await source.close();
    const sent = numbered(dlq, 5);
    await publishAll(admin.sourceUrl, dlq, sent.messages);
    const migrate = (target: string) =>
      runCli([
        'migrate',
        ...connection({ target }),
        '--source-queue',
        dlq,
        '--declare-target',
        '--source-management',
        asUser(admin.sourceManagementUrl, sourceUser, PASSWORD),
        '--idle-timeout',
        '300ms',
        '--quiet',
      ]);

    const noRead = await migrate(dlxNoReadUser);
    expect(noRead.code).toBe(2);
    expect(noRead.stderr).toBe(
      `dedup-bridge: --declare-target: creating target queue "${dlq}" refused: access to queue '${dlq}' in vhost '/' refused for user '${dlxNoReadUser}'; grant the user configure permission on the queue (with dead-letter exchange "${dlx}" it also needs read permission on the queue and write permission on "${dlx}"), or declare the queue beforehand\n`,
    );
    const noWrite = await migrate(dlxNoWriteUser);
    expect(noWrite.code).toBe(2);
    expect(noWrite.stderr).toContain(
      `refused: access to exchange '${dlx}' in vhost '/' refused for user '${dlxNoWriteUser}'`,
    );
    expect(await depthOf(admin.sourceUrl, dlq)).toBe(5);

    const declared = await migrate(dlxUser);
    expect(declared.stderr).toBe('');
    expect(declared.code).toBe(0);
    const { count } = await delivered('privilege declare with DLX', admin.targetUrl, dlq, sent.ids);
    expect(count).toMatchObject({ received: 5, lost: 0, duplicated: 0, unexpected: 0 });
    // Declared with the source's dead-letter exchange (a declaration with other arguments fails).
    const check = await openBroker(admin.targetUrl);
    await expect(
      check.channel.assertQueue(dlq, { durable: true, arguments: { 'x-dead-letter-exchange': dlx } }),
    ).resolves.toMatchObject({ queue: dlq });
    await check.close();
  });

  it('one permission less stops at once, naming it (exit 2), and moves nothing', async () => {
    await declareQueue(admin.sourceUrl, refusedQueue);
    await declareQueue(admin.targetUrl, refusedQueue);
    await publishAll(admin.sourceUrl, refusedQueue, numbered(refusedQueue, 3).messages);
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

    // A Redis user without SET: refused at its first write (migrate's job lock), before any claim.
    const noSet = await migrate({ redis: noSetUser });
    expect(noSet.code, noSet.stderr).toBe(2);
    expect(noSet.stderr).toMatch(
      /^dedup-bridge: Redis refused taking the job lock \(NOPERM [^\n]*'set' command\); give the user the ACL that docs\/security\.md, Least privilege, lists\n$/,
    );
    // run takes no job lock: refused where it writes the scope's layout.
    const run = await runCli(
      [
        'run',
        ...connection({ redis: noSetUser }),
        '--source-queue',
        refusedQueue,
        '--target-queue',
        refusedQueue,
      ],
      {
        timeoutMs: 30_000,
      },
    );
    expect(run.code, run.stderr).toBe(2);
    expect(run.stderr).toMatch(
      /^dedup-bridge: Redis refused opening the dedup scope \(NOPERM [^\n]*'set' command\); give the user the ACL that docs\/security\.md, Least privilege, lists\n$/,
    );

    expect(await depthOf(admin.sourceUrl, refusedQueue)).toBe(3);
    expect(await depthOf(admin.targetUrl, refusedQueue)).toBe(0);
  });
});
