import { describe, expect, it } from 'vitest';
import { redisVersionProblem } from '../../src/dedup/cache.js';

const info = (version: string) => `# Server\r\nredis_version:${version}\r\nredis_mode:standalone\r\n`;

describe('the Redis version check', () => {
  it('takes 6.2 and later', () => {
    for (const version of ['6.2.0', '6.2.14', '7.0.15', '7.2.4', '8.0.0', '10.1.0']) {
      expect(redisVersionProblem(info(version))).toBeUndefined();
    }
  });

  it('refuses older versions with one line that says what to do', () => {
    for (const version of ['6.0.16', '5.0.14', '4.0.9']) {
      expect(redisVersionProblem(info(version))).toBe(
        `Redis ${version} is too old: dedup-bridge needs Redis 6.2 or later (its scripts use GETDEL); upgrade Redis or point --redis at a newer one`,
      );
    }
  });

  it('lets a server that does not say its version through (the scripts then decide)', () => {
    expect(redisVersionProblem('# Server\r\nredis_mode:standalone\r\n')).toBeUndefined();
  });
});
