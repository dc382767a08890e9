import { type ChildProcess, spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { stringify } from 'yaml';
import { FaultProxy } from '../harness/proxy.js';
import { freePort } from '../harness/servers.js';
import {
  metricsUrl,
  numbered,
  publishAll,
  queuePair,
  runArgs,
  startCli,
  takeAll,
  waitFor,
  withOption,
} from '../helpers.js';
import { alertRules, dashboardQueries, requirePrometheus, withGrafanaValues } from '../monitoring.js';

// docs/monitoring on a real Prometheus (Debian's package) scraping a real `dedup-bridge run`: the
// dashboard's queries run, a working route fires no alert, and a route whose source broker is cut
// away fires DedupBridgeNotConsuming. The source goes through a FaultProxy, so the harness's broker,
// which other tests use, is never stopped: stopping the proxy is the source going away.

// Panels whose queries have series once the route has forwarded (rates of 0 and NaN quantiles count).
const HAVE_DATA = [
  'Consuming',
  'Source depth',
  'Forwarded and duplicates',
  'Confirm latency',
  'Connection state per side',
  'Readiness',
  'Process memory and event loop',
];

interface Alert {
  labels: Record<string, string>;
  state: 'pending' | 'firing';
}

interface QueryAnswer {
  status: string;
  error?: string;
  data?: { result: unknown[] };
}

class Prometheus {
  private readonly dir = mkdtempSync(join(tmpdir(), 'dedup-prometheus-'));
  private process: ChildProcess | undefined;
  private output = '';
  url = '';

  /** Starts a server that scrapes `target` (host:port) every second and evaluates the rules every second. */
  async start(target: string): Promise<void> {
    requirePrometheus('prometheus');
    // The rules as shipped, each `for:` cut to 2 s so that the test takes seconds, not minutes
    // (the expressions are unchanged; promtool tests the real durations, test/unit/alerts.test.ts).
    const rules = alertRules();
    for (const group of rules.groups) for (const rule of group.rules) if (rule.for) rule.for = '2s';
    writeFileSync(join(this.dir, 'alerts.yml'), stringify(rules));
    writeFileSync(
      join(this.dir, 'prometheus.yml'),
      stringify({
        global: { scrape_interval: '1s', scrape_timeout: '1s', evaluation_interval: '1s' },
        rule_files: [join(this.dir, 'alerts.yml')],
        scrape_configs: [{ job_name: 'dedup-bridge', static_configs: [{ targets: [target] }] }],
      }),
    );
    const port = await freePort();
    this.url = `http://127.0.0.1:${port}`;
    const child = spawn(
      'prometheus',
      [
        `--config.file=${join(this.dir, 'prometheus.yml')}`,
        `--storage.tsdb.path=${join(this.dir, 'data')}`,
        `--web.listen-address=127.0.0.1:${port}`,
        '--log.level=warn',
      ],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    );
    this.process = child;
    child.stdout?.on('data', (chunk: Buffer) => {
      this.output += chunk.toString();
    });
    child.stderr?.on('data', (chunk: Buffer) => {
      this.output += chunk.toString();
    });
    const ready = await waitFor(async () => {
      if (child.exitCode !== null) return true;
      return (await fetch(`${this.url}/-/ready`).catch(() => undefined))?.status === 200;
    }, 30_000);
    expect(ready && child.exitCode === null, `prometheus did not start:\n${this.output}`).toBe(true);
  }

  async query(expr: string): Promise<QueryAnswer> {
    const answer = await fetch(`${this.url}/api/v1/query?query=${encodeURIComponent(expr)}`);
    return (await answer.json()) as QueryAnswer;
  }

  async alerts(): Promise<Alert[]> {
    const answer = (await (await fetch(`${this.url}/api/v1/alerts`)).json()) as {
      data: { alerts: Alert[] };
    };
    return answer.data.alerts;
  }

  log(): string {
    return this.output;
  }

  async stop(): Promise<void> {
    const child = this.process;
    if (child && child.exitCode === null) {
      const exited = new Promise((resolve) => child.once('exit', resolve));
      child.kill('SIGTERM');
      await exited;
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

describe('the alerting rules and the dashboard on a real Prometheus', () => {
  it('scraping a running bridge: the dashboard queries answer, nothing fires while it forwards, and DedupBridgeNotConsuming fires once its source broker is gone', async () => {
    const { sourceUrl, targetUrl, source, target } = await queuePair();
    const proxy = FaultProxy.forUrl(sourceUrl);
    await proxy.start();
    const args = withOption(runArgs(source, ['--target-queue', target]), '--source', proxy.urlFor(sourceUrl));
    const bridge = startCli([...args, '--metrics-port', '0', '--metrics-host', '127.0.0.1']);
    const prometheus = new Prometheus();
    try {
      const metrics = new URL(await metricsUrl(bridge));
      await prometheus.start(metrics.host);

      // A working route: messages forwarded, so that the counters and histograms have series.
      const { messages } = numbered('prom', 20);
      await publishAll(sourceUrl, source, messages);
      let arrived = 0;
      expect(
        await waitFor(async () => {
          arrived += (await takeAll(targetUrl, target)).length;
          return arrived >= 20;
        }, 30_000),
      ).toBe(true);
      const consuming = `dedup_bridge_consuming{route="${source}"} == 1`;
      const scraped = await waitFor(
        async () => ((await prometheus.query(consuming)).data?.result.length ?? 0) > 0,
      );
      expect(scraped, `${prometheus.log()}\n${bridge.output()}`).toBe(true);
      expect(
        await waitFor(
          async () =>
            ((await prometheus.query(`dedup_bridge_forwarded_total{route="${source}"} >= 20`)).data?.result
              .length ?? 0) > 0,
        ),
      ).toBe(true);

      // A rate needs two samples in its window: three scrapes of the route first.
      const scrapes = `count_over_time(dedup_bridge_consumed_total{route="${source}"}[10s]) >= 3`;
      expect(
        await waitFor(async () => ((await prometheus.query(scrapes)).data?.result.length ?? 0) > 0),
      ).toBe(true);

      // Every dashboard query is one Prometheus accepts; those of the route's state have data.
      for (const { title, expr } of dashboardQueries()) {
        const answer = await prometheus.query(withGrafanaValues(expr, '10s'));
        expect(answer.status, `${title}: ${expr}: ${answer.error}`).toBe('success');
        if (HAVE_DATA.includes(title))
          expect(answer.data?.result.length, `${title}: ${expr}`).toBeGreaterThan(0);
      }

      // A working route fires nothing, pending included, over several evaluations.
      await new Promise((resolve) => setTimeout(resolve, 4000));
      expect(await prometheus.alerts()).toEqual([]);

      // The source broker goes away: connections reset, and nothing listens any more.
      await proxy.stop();
      let alerts: Alert[] = [];
      const fired = await waitFor(async () => {
        alerts = await prometheus.alerts();
        return alerts.some(
          (alert) =>
            alert.labels.alertname === 'DedupBridgeNotConsuming' &&
            alert.labels.route === source &&
            alert.state === 'firing',
        );
      }, 30_000);
      expect(fired, `${JSON.stringify(alerts)}\n${prometheus.log()}`).toBe(true);
      const notConsuming = alerts.find((alert) => alert.labels.alertname === 'DedupBridgeNotConsuming');
      expect(notConsuming?.labels).toMatchObject({ severity: 'critical', job: 'dedup-bridge' });
    } finally {
      bridge.signal('SIGTERM');
      await bridge.done;
      await prometheus.stop();
      await proxy.stop();
    }
  }, 90_000);
});
