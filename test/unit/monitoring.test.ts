import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { BridgeMetrics } from '../../src/observe/metrics.js';
import { alertRules, dashboard, dashboardQueries, metricNamesIn, panelsOf } from '../monitoring.js';

// The dashboard and the alerting rules of docs/monitoring read only metrics the bridge exports, and
// each alert's runbook is a section of docs/operations.md.

/** The series names a scrape of the bridge can hold: its registry's metrics, histograms by their series. */
async function exported(): Promise<Set<string>> {
  const metrics = new BridgeMetrics();
  try {
    const names = new Set<string>();
    for (const metric of await metrics.registry.getMetricsAsJSON()) {
      const type = String(metric.type);
      if (type === 'histogram') {
        for (const suffix of ['_bucket', '_sum', '_count']) names.add(metric.name + suffix);
      } else if (type === 'summary') {
        for (const suffix of ['', '_sum', '_count']) names.add(metric.name + suffix);
      } else names.add(metric.name);
    }
    return names;
  } finally {
    metrics.stop();
  }
}

// Grafana's variable for the data source, in every panel and query.
const DATASOURCE = '$' + '{datasource}';

// Series Prometheus makes itself for every target it scrapes.
const SCRAPE_SERIES = new Set(['up']);

/** A heading's anchor as GitHub makes it (as in docs.test.ts). */
function slug(heading: string): string {
  return heading
    .toLowerCase()
    .replace(/[^\p{L}\p{N} _-]/gu, '')
    .replace(/ /g, '-');
}

describe('the dashboard and the alerts use what the bridge exports', () => {
  it('reads metric names out of PromQL', () => {
    expect(
      metricNamesIn(
        'histogram_quantile(0.99, sum by (route, le) (rate(dedup_bridge_commit_seconds_bucket{route=~"$route"}[5m]))) > 0.5',
      ),
    ).toEqual(['dedup_bridge_commit_seconds_bucket']);
    expect(
      metricNamesIn(
        'process_resident_memory_bytes * on (job, instance) group_left () group by (job, instance) (dedup_bridge_consuming{side="a b"}) and up == 0 offset 5m',
      ),
    ).toEqual(['process_resident_memory_bytes', 'dedup_bridge_consuming', 'up']);
    expect(metricNamesIn('label_values(dedup_bridge_consuming, route)')).toEqual([
      'dedup_bridge_consuming',
      'route',
    ]);
  });

  it('every metric of every dashboard query and every alert is one the bridge exports', async () => {
    const known = await exported();
    expect(known).toContain('dedup_bridge_forwarded_total');
    expect(known).toContain('dedup_bridge_confirm_seconds_bucket');
    const board = dashboard();
    const queries = [
      ...dashboardQueries(board).map(({ title, expr }) => ({ where: `dashboard: ${title}`, expr })),
      ...alertRules().groups.flatMap((group) =>
        group.rules.map((rule) => ({ where: `alert ${rule.alert}`, expr: rule.expr })),
      ),
    ];
    const used = new Set<string>();
    for (const { where, expr } of queries) {
      const names = metricNamesIn(expr);
      expect(names.length, `${where}: no metric in ${expr}`).toBeGreaterThan(0);
      for (const name of names) {
        expect(known.has(name) || SCRAPE_SERIES.has(name), `${where}: ${name} is not exported`).toBe(true);
        used.add(name);
      }
    }
    // The route variable's query: label_values(<metric>, route).
    for (const variable of board.templating.list) {
      const query = typeof variable.query === 'string' ? variable.query : variable.query.query;
      const labelValues = /^label_values\((\w+),\s*(\w+)\)$/.exec(query);
      if (variable.type !== 'query') continue;
      expect(labelValues, `variable ${variable.name}: ${query}`).not.toBeNull();
      expect(known, `variable ${variable.name}`).toContain(labelValues?.[1]);
      expect(labelValues?.[2]).toBe(variable.name);
    }
    // The panels of issue 32: each is drawn from its metric.
    for (const name of [
      'dedup_bridge_forwarded_total',
      'dedup_bridge_duplicates_total',
      'dedup_bridge_in_doubt_total',
      'dedup_bridge_refused_total',
      'dedup_bridge_parked_total',
      'dedup_bridge_source_queue_depth',
      'dedup_bridge_claim_seconds_bucket',
      'dedup_bridge_confirm_seconds_bucket',
      'dedup_bridge_commit_seconds_bucket',
      'dedup_bridge_connection_up',
      'dedup_bridge_consuming',
      'dedup_bridge_claims_lost_total',
    ])
      expect(used, name).toContain(name);
  });

  it('the dashboard has a datasource and a route variable, and every query uses both', () => {
    const board = dashboard();
    const variables = board.templating.list;
    expect(variables.find((variable) => variable.name === 'datasource')?.type).toBe('datasource');
    expect(variables.find((variable) => variable.name === 'route')?.datasource?.uid).toBe(DATASOURCE);
    for (const panel of panelsOf(board).filter((panel) => panel.type !== 'row')) {
      expect(panel.datasource?.uid, panel.title).toBe(DATASOURCE);
      expect(panel.targets?.length, panel.title).toBeGreaterThan(0);
      for (const target of panel.targets ?? []) {
        expect(target.datasource?.uid, panel.title).toBe(DATASOURCE);
        expect(target.expr, panel.title).toContain('route=~"$route"');
      }
    }
  });

  it('every alert is named DedupBridge…, has a severity, a summary, a description and a runbook in docs/operations.md', () => {
    const operations = readFileSync(new URL('../../docs/operations.md', import.meta.url), 'utf8');
    const anchors = [...operations.matchAll(/^#+ (.+)$/gm)].map((heading) => slug(heading[1] as string));
    const rules = alertRules().groups.flatMap((group) => group.rules);
    expect(rules.length).toBeGreaterThan(5);
    for (const rule of rules) {
      expect(rule.alert).toMatch(/^DedupBridge[A-Z]\w+$/);
      expect(['critical', 'warning', 'info'], rule.alert).toContain(rule.labels?.severity);
      expect(rule.annotations?.summary, rule.alert).toBeTruthy();
      expect(rule.annotations?.description, rule.alert).toBeTruthy();
      const runbook = /^docs\/operations\.md#([\w-]+)$/.exec(rule.annotations?.runbook_url ?? '');
      expect(runbook, `${rule.alert}: ${rule.annotations?.runbook_url}`).not.toBeNull();
      expect(anchors, `${rule.alert}: ${rule.annotations?.runbook_url}`).toContain(runbook?.[1]);
      // The runbook section names the alert, so that a reader who followed the link finds it.
      const section = operations
        .split(/^#+ /m)
        .find((text) => slug(text.split('\n')[0] ?? '') === runbook?.[1]);
      expect(section, rule.alert).toContain(rule.alert);
    }
  });
});
