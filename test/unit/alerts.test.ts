import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { parse } from 'yaml';
import { ALERTS, alertRules, requirePrometheus } from '../monitoring.js';

// The alerting rules of docs/monitoring/alerts.yml, checked and unit-tested by promtool (Debian's
// prometheus package) on the series of alerts.promtool.yml.

const TESTS = new URL('./alerts.promtool.yml', import.meta.url);

/** Runs promtool; without it, fails with one line saying how to get it (the test is not skipped). */
function promtool(...args: string[]): { code: number | null; output: string } {
  requirePrometheus('promtool');
  const run = spawnSync('promtool', args, { encoding: 'utf8' });
  if (run.error) throw run.error;
  return { code: run.status, output: run.stdout + run.stderr };
}

interface RuleTest {
  name: string;
  alert_rule_test: { eval_time: string; alertname: string; exp_alerts?: unknown[] }[];
}

describe('the alerting rules, by promtool', () => {
  const names = alertRules().groups.flatMap((group) => group.rules.map((rule) => rule.alert));

  it('promtool check rules accepts them', () => {
    const check = promtool('check', 'rules', fileURLToPath(ALERTS));
    expect(check.output).toContain(`SUCCESS: ${names.length} rules found`);
    expect(check.code, check.output).toBe(0);
  });

  it('promtool test rules: each alert fires on its series, and a working route fires none', () => {
    const run = promtool('test', 'rules', fileURLToPath(TESTS));
    expect(run.code, run.output).toBe(0);
    expect(run.output).toContain('SUCCESS');
  });

  it('the promtool tests cover every alert: firing in a case of its own, and silent for the healthy route', () => {
    const tests = (parse(readFileSync(TESTS, 'utf8')) as { tests: RuleTest[] }).tests;
    const healthy = tests.find((test) => test.name === 'healthy route fires nothing');
    expect(healthy).toBeDefined();
    for (const name of names) {
      const silent = healthy?.alert_rule_test.filter((check) => check.alertname === name) ?? [];
      expect(silent.length, `${name}: no check in the healthy case`).toBeGreaterThan(0);
      for (const check of silent) expect(check.exp_alerts, name).toEqual([]);
      const fires = tests
        .filter((test) => test !== healthy)
        .flatMap((test) => test.alert_rule_test)
        .filter((check) => check.alertname === name && (check.exp_alerts?.length ?? 0) > 0);
      expect(fires.length, `${name}: no case where it fires`).toBeGreaterThan(0);
    }
  });
});
