import { describe, expect, it } from 'vitest';
import { parseStreamUrl, redactStreamUrl } from '../../src/config/stream-url.js';
import { ConfigError } from '../../src/errors.js';

describe('stream URLs', () => {
  it('reads user, password, host, port and vhost', () => {
    expect(parseStreamUrl('rabbitmq-stream://bob:pw@broker.example:5553/orders')).toEqual({
      host: 'broker.example',
      port: 5553,
      vhost: 'orders',
      username: 'bob',
      password: 'pw',
      tls: false,
    });
  });

  it('defaults: port 5552 (5551 with TLS), vhost "/", guest/guest', () => {
    expect(parseStreamUrl('rabbitmq-stream://h')).toMatchObject({
      port: 5552,
      vhost: '/',
      username: 'guest',
      password: 'guest',
    });
    expect(parseStreamUrl('rabbitmq-stream://u:p@h/')).toMatchObject({ port: 5552, vhost: '/' });
    expect(parseStreamUrl('rabbitmq-stream+tls://u:p@h')).toMatchObject({ port: 5551, tls: true });
  });

  it('percent-decodes user, password and vhost; %2F is the default vhost', () => {
    expect(parseStreamUrl('rabbitmq-stream://a%40b:p%3A%2F%40%25x@h/%2F')).toMatchObject({
      username: 'a@b',
      password: 'p:/@%x',
      vhost: '/',
    });
    expect(parseStreamUrl('rabbitmq-stream://u:p@h/a%2Fb%20c')).toMatchObject({ vhost: 'a/b c' });
    expect(parseStreamUrl('rabbitmq-stream://u:@h')).toMatchObject({ username: 'u', password: '' });
  });

  it('IPv6 hosts', () => {
    expect(parseStreamUrl('rabbitmq-stream://u:p@[::1]:6000/v')).toMatchObject({ host: '::1', port: 6000 });
  });

  it('refusals are ConfigErrors without the password', () => {
    const cases = [
      'amqp://u:s3cretPW@h/v',
      'rabbitmq-stream://u:s3cretPW@h/a/b',
      'rabbitmq-stream://u:s3cretPW@h/v?x=1',
      'rabbitmq-stream://u:s3cretPW@h:99999/v',
      'rabbitmq-stream://u:s3cretPW@/v',
      'rabbitmq-stream://u:s3cretPW@h/%E0%A4%A',
      'rabbitmq-stream://u:s3cretPW%zz@h/v',
    ];
    for (const url of cases) {
      let error: unknown;
      try {
        parseStreamUrl(url);
      } catch (e) {
        error = e;
      }
      expect(error, url).toBeInstanceOf(ConfigError);
      expect(`${(error as Error).message} ${JSON.stringify(error)}`).not.toContain('s3cretPW');
    }
  });

  it('redacts a password', () => {
    expect(redactStreamUrl('rabbitmq-stream://u:p%40w@h:5552/v')).toBe('rabbitmq-stream://u:***@h:5552/v');
    expect(redactStreamUrl('rabbitmq-stream://h:5552/v')).toBe('rabbitmq-stream://h:5552/v');
  });
});
