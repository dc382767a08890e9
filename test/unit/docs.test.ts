import { existsSync, readdirSync, readFileSync } from 'node:fs';
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
  // The benchmark's own options (npm run bench -- …) are documented in the same pages.
  const bench = [
    ...['bench/run.ts', 'bench/redis-cost.ts', 'bench/stream.ts']
      .map(read)
      .join('\n')
      .matchAll(/'(--[a-z-]+)'/g),
  ].map((match) => match[1] as string);
  return new Set([...defined, ...bench, '--help', '--version']);
}

/** A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens. */
function slug(heading: string): string {
  return heading
    .toLowerCase()
    .replace(/[^\p{L}\p{N} _-]/gu, '')
    .replace(/ /g, '-');
}

/** The README and every page in docs/, by path. */
function pages(): Map<string, string> {
  const names = readdirSync(new URL('../../docs/', import.meta.url)).filter((name) => name.endsWith('.md'));
  return new Map(['README.md', ...names.map((name) => `docs/${name}`)].map((path) => [path, read(path)]));
}

/** The environment variables the CLI reads, from its source. */
function cliVariables(): string[] {
  const source = read('src/cli/options.ts');
  const named = [...source.matchAll(/\.env\(\s*'(DEDUP_BRIDGE_[A-Z_]+)'/g)].map(
    (match) => match[1] as string,
  );
  // The TLS options' variables are derived from their flags: --target-ca is DEDUP_BRIDGE_TARGET_CA.
  const tls = [...source.matchAll(/'--((?:source|target|redis)-(?:ca|cert|key)) <file>'/g)].map(
    (match) => `DEDUP_BRIDGE_${(match[1] as string).replace(/-/g, '_').toUpperCase()}`,
  );
  return [...named, ...tls];
}

describe('the docs match the code', () => {
  const docs = pages();
  const guide = read('docs/migration.md');
  const cli = read('docs/cli.md');
  const options = cliOptions();

  it('the README’s first block is the two commands: run it (the demo) and test it', () => {
    const first = blocks(read('README.md'), 'sh')[0] ?? '';
    const commands = first
      .split('\n')
      .map((line) => line.replace(/#.*/, '').trim())
      .filter((line) => line.length > 0);
    expect(commands).toEqual(['npm ci && npm run demo', 'npm test']);
    const scripts = JSON.parse(read('package.json')).scripts as Record<string, string>;
    expect(scripts.demo).toBeDefined();
    expect(scripts.test).toBeDefined();
  });

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

  it('every option the README and the docs pages mention exists', () => {
    expect([...docs.keys()]).toEqual(
      expect.arrayContaining(['README.md', 'docs/cli.md', 'docs/migration.md']),
    );
    // Other tools' flags (docker, npm, node, flock) are not ours, nor a rabbitmqctl command's.
    const ours = (line: string) => !/docker|npm |node |flock|apt-get/.test(line);
    const withoutRabbitmqctl = (line: string) => line.replace(/`rabbitmqctl [^`]*`/g, '');
    for (const [path, text] of docs) {
      for (const line of text.split('\n').filter(ours).map(withoutRabbitmqctl)) {
        for (const match of line.matchAll(/(?:^|[\s`[(])(--[a-z][a-z-]+)/g))
          expect(options, `${path}: ${line}`).toContain(match[1]);
      }
    }
  });

  it('the CLI reference lists every option of the CLI', () => {
    const listed = new Set(
      [...cli.matchAll(/^\| (?:[a-z]+: )?`(--[a-z-]+)/gm)].map((match) => match[1] as string),
    );
    const source = ['src/cli/options.ts', 'src/cli/cache.ts'].map(read).join('\n');
    for (const match of source.matchAll(/'(--[a-z-]+)[ '<]/g)) {
      // The TLS cert and key flags share the CA flag's row; the cache tools' are in Operations.
      const flag = match[1] as string;
      const mentioned = new RegExp(`${flag}(?![a-z-])`).test(cli + read('docs/operations.md'));
      expect(listed.has(flag) || mentioned, flag).toBe(true);
    }
  });

  it('documents each exit code the CLI uses, in the CLI reference', () => {
    const codes = read('src/errors.ts');
    for (const match of codes.matchAll(/^\s+\w+: (\d+),$/gm)) {
      expect(cli).toMatch(new RegExp(`^\\| ${match[1]}\\s+\\|`, 'm'));
    }
  });

  it('lists each environment variable the CLI reads, in Configuration', () => {
    const variables = cliVariables();
    expect(variables).toContain('DEDUP_BRIDGE_REDIS_KEY');
    const page = read('docs/configuration.md');
    for (const variable of variables) expect(page, variable).toContain(`\`${variable}\``);
  });

  it('no example puts a password in a flag, where ps shows it to every user of the host', () => {
    const manifests = readdirSync(new URL('../../docs/kubernetes/', import.meta.url)).map(
      (name) => [`docs/kubernetes/${name}`, read(`docs/kubernetes/${name}`)] as const,
    );
    // A flag whose value is a URL with user:password@, or a variable that holds one.
    const inFlag = /--[a-z-]+[ =]+["']?(?:[a-z-]+:\/\/[^\s/@"']*:[^\s@"']+@|"?\$)/;
    for (const [path, text] of [...docs, ...manifests]) {
      for (const line of text.split('\n')) expect(line, path).not.toMatch(inFlag);
    }
  });

  it('every relative link points at a file that exists, and every #anchor at a heading of it', () => {
    for (const [path, text] of docs) {
      const folder = new URL(`../../${path}`, import.meta.url);
      for (const match of text.matchAll(/\]\(([^)\s]+)\)/g)) {
        const link = match[1] as string;
        if (/^[a-z]+:/.test(link)) continue;
        const [file, anchor] = link.split('#') as [string, string | undefined];
        const target = file === '' ? folder : new URL(file, folder);
        expect(existsSync(target), `${path}: ${link}`).toBe(true);
        if (!anchor) continue;
        const headings = [...readFileSync(target, 'utf8').matchAll(/^#+ (.+)$/gm)].map((heading) =>
          slug(heading[1] as string),
        );
        expect(headings, `${path}: ${link}`).toContain(anchor);
      }
    }
  });
});
