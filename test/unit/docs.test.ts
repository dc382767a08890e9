import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { parse } from 'yaml';

const read = (path: string) => readFileSync(new URL(`../../${path}`, import.meta.url), 'utf8');

/** The fenced blocks of a language in a Markdown file. */
function blocks(markdown: string, language: string): string[] {
  const pattern = new RegExp(`\`\`\`${language}\\n([\\s\\S]*?)\`\`\``, 'g');
  return [...markdown.matchAll(pattern)].map((match) => match[1] as string);
}

/** Every long option the CLI defines, read from its source, so docs cannot drift from it. */
function cliOptions(): Set<string> {
  const source = ['src/cli/options.ts', 'src/cli/cache.ts'].map(read).join('\n');
  const defined = [...source.matchAll(/'(--[a-z-]+)[ '<]/g)].map((match) => match[1] as string);
  // The benchmark's own options (npm run bench -- …) are documented in the same README.
  const bench = [...read('bench/run.ts').matchAll(/'(--[a-z-]+)'/g)].map((match) => match[1] as string);
  return new Set([...defined, ...bench, '--help', '--version']);
}

describe('the docs match the code', () => {
  const guide = read('docs/migration.md');
  const readme = read('README.md');
  const options = cliOptions();

  it('the migration guide’s YAML examples parse, and the CronJob forbids overlapping runs', () => {
    const documents = blocks(guide, 'yaml').map((text) => parse(text));
    const cronJob = documents.find((doc) => doc?.kind === 'CronJob');
    expect(cronJob?.spec?.concurrencyPolicy).toBe('Forbid');
    const container = cronJob?.spec?.jobTemplate?.spec?.template?.spec?.containers?.[0];
    expect(container?.args?.[0]).toBe('migrate');
    for (const arg of container.args as string[]) if (arg.startsWith('--')) expect(options).toContain(arg);
    const envNames = (container.env as { name: string }[]).map((item) => item.name);
    expect(envNames).toEqual(['DEDUP_BRIDGE_SOURCE', 'DEDUP_BRIDGE_TARGET', 'DEDUP_BRIDGE_REDIS']);
    const jobFile = documents.find((doc) => Array.isArray(doc?.queues));
    expect(jobFile?.queues).toContainEqual({ source: 'audit', target: 'audit-v2' });
  });

  it('every option the README and the guide mention exists', () => {
    // Other tools' flags (docker, npm, flock) are not ours.
    const ours = (line: string) => !/docker|npm |flock|apt-get/.test(line);
    for (const text of [readme, guide]) {
      for (const line of text.split('\n').filter(ours)) {
        for (const match of line.matchAll(/(?:^|[\s`[(])(--[a-z][a-z-]+)/g))
          expect(options).toContain(match[1]);
      }
    }
  });

  it('documents each exit code the CLI uses', () => {
    const codes = read('src/errors.ts');
    for (const match of codes.matchAll(/^\s+\w+: (\d+),$/gm)) {
      expect(readme).toMatch(new RegExp(`^\\| ${match[1]}\\s+\\|`, 'm'));
    }
  });
});
