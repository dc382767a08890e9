import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { parse } from 'yaml';

// The dashboard and the alerting rules of docs/monitoring, read for the tests that check them
// (test/unit/monitoring.test.ts, test/unit/alerts.test.ts, test/integration/prometheus.test.ts).

const DASHBOARD = new URL('../docs/monitoring/dashboard.json', import.meta.url);
export const ALERTS = new URL('../docs/monitoring/alerts.yml', import.meta.url);

/**
 * Fails, in one line saying how to get it, when a program of Debian's prometheus package is not
 * installed: the tests that need it fail rather than skip.
 */
export function requirePrometheus(program: 'prometheus' | 'promtool'): void {
  const run = spawnSync(program, ['--version'], { encoding: 'utf8' });
  if ((run.error as NodeJS.ErrnoException | undefined)?.code === 'ENOENT') {
    throw new Error(
      `${program} not found: install Debian's prometheus package (apt-get install prometheus), as .ci/run does`,
    );
  }
}

interface AlertRule {
  alert: string;
  expr: string;
  for?: string;
  labels?: Record<string, string>;
  annotations?: Record<string, string>;
}

export interface RuleFile {
  groups: { name: string; rules: AlertRule[] }[];
}

export function alertRules(): RuleFile {
  return parse(readFileSync(ALERTS, 'utf8')) as RuleFile;
}

interface Panel {
  type: string;
  title: string;
  datasource?: { type?: string; uid?: string };
  targets?: { expr: string; datasource?: { uid?: string } }[];
  panels?: Panel[];
}

export interface Dashboard {
  panels: Panel[];
  templating: {
    list: { name: string; type: string; query: string | { query: string }; datasource?: { uid?: string } }[];
  };
}

export function dashboard(): Dashboard {
  return JSON.parse(readFileSync(DASHBOARD, 'utf8')) as Dashboard;
}

/** Every panel, those inside rows included. */
export function panelsOf(board: Dashboard): Panel[] {
  return board.panels.flatMap((panel) => [panel, ...(panel.panels ?? [])]);
}

/** Each panel query of the dashboard, with the panel's title. */
export function dashboardQueries(board = dashboard()): { title: string; expr: string }[] {
  return panelsOf(board).flatMap((panel) =>
    (panel.targets ?? []).map((target) => ({ title: panel.title, expr: target.expr })),
  );
}

/** A dashboard query as Prometheus takes it: Grafana's variables given values (every route). */
export function withGrafanaValues(expr: string, rateInterval = '1m'): string {
  return expr.replaceAll('$route', '.*').replaceAll('$__rate_interval', rateInterval);
}

// Words of PromQL that are not metric names: aggregations, operators, modifiers, and the functions
// the dashboard and the rules call (a function not listed here shows up as an unknown metric).
const PROMQL_WORDS = new Set([
  'sum',
  'min',
  'max',
  'avg',
  'count',
  'group',
  'stddev',
  'stdvar',
  'topk',
  'bottomk',
  'quantile',
  'count_values',
  'and',
  'or',
  'unless',
  'bool',
  'offset',
  'atan2',
  'rate',
  'irate',
  'increase',
  'delta',
  'deriv',
  'histogram_quantile',
  'absent',
  'clamp_min',
  'clamp_max',
  'predict_linear',
  'max_over_time',
  'min_over_time',
  'avg_over_time',
  'changes',
  'resets',
  'label_values',
  'inf',
  'nan',
]);

/**
 * The metric names a PromQL expression reads, roughly: string literals, label matchers `{…}`,
 * ranges `[…]` and the label lists of by/without/on/ignoring/group_left/group_right are dropped;
 * what is left that looks like an identifier and is not a word of PromQL is a metric name.
 */
export function metricNamesIn(expr: string): string[] {
  const bare = expr
    .replace(/"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'/g, '""')
    .replace(/\{[^}]*\}/g, ' ')
    .replace(/\[[^\]]*\]/g, ' ')
    .replace(/\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)/g, ' ');
  const names = [...bare.matchAll(/(?<![\w.$:])[a-zA-Z_:][\w:]*/g)].map((match) => match[0]);
  return names.filter((name) => !PROMQL_WORDS.has(name.toLowerCase()));
}
