import { describe, expect, it } from 'vitest';
import { outageLine } from '../../src/bridge/bridge.js';
import { redisRefusalOf, replyText } from '../../src/dedup/redis.js';

// The line a run ends with when a server stays out past --retry-for (issue 34.4).

describe('replyText', () => {
  it('is the reply without the script location Redis adds, nor the full stop', () => {
    const error = Object.assign(
      new Error(
        "OOM command not allowed when used memory > 'maxmemory'. script: 79720af8cdb966cb479c69395203638881e99516, on @user_script:1.",
      ),
      { name: 'ReplyError' },
    );
    expect(replyText(error)).toBe("OOM command not allowed when used memory > 'maxmemory'");
    expect(replyText(new Error("READONLY You can't write against a read only replica.\nmore"))).toBe(
      "READONLY You can't write against a read only replica",
    );
  });
});

describe('redisRefusalOf', () => {
  it('names what each reply means and what to do', () => {
    expect(redisRefusalOf("OOM command not allowed when used memory > 'maxmemory'")).toMatchObject({
      how: 'refused writes',
      advice: expect.stringMatching(/raise its maxmemory or free memory/),
    });
    expect(redisRefusalOf("READONLY You can't write against a read only replica").advice).toMatch(
      /names a replica: give the master/,
    );
    expect(redisRefusalOf('LOADING Redis is loading the dataset in memory').how).toBe(
      'answered that it is loading its data',
    );
    expect(redisRefusalOf('ERR something else')).toEqual({ how: 'failed every call', advice: 'see its log' });
  });
});

describe('outageLine', () => {
  it('keeps the line of an unreachable server as it was', () => {
    expect(outageLine({ what: 'target broker at amqp://h:5672', how: 'unreachable', ms: 2400 })).toBe(
      'target broker at amqp://h:5672 unreachable for 2s (--retry-for); nothing unforwarded was acked',
    );
  });

  it('gives the reason and the advice of a server that answers but refuses', () => {
    expect(
      outageLine({
        what: 'Redis at redis://h:6379',
        how: 'refused writes',
        reason: "OOM command not allowed when used memory > 'maxmemory'",
        advice: 'raise its maxmemory',
        ms: 5000,
      }),
    ).toBe(
      "Redis at redis://h:6379 refused writes for 5s (OOM command not allowed when used memory > 'maxmemory'), past --retry-for: raise its maxmemory; nothing unforwarded was acked",
    );
  });
});
