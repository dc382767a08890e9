import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';

const ROOT = new URL('..', import.meta.url).pathname;

/** README.md and the pages under docs/: wherever the Least privilege section lives. */
function docFiles(): string[] {
  const docs = join(ROOT, 'docs');
  const pages = readdirSync(docs, { recursive: true, encoding: 'utf8' })
    .filter((name) => name.endsWith('.md'))
    .map((name) => join(docs, name));
  return [join(ROOT, 'README.md'), ...pages];
}

/**
 * The `ACL SETUSER` lines the docs print under a `# …` comment containing `label`, each as the
 * user's name and its rules, exactly as written there (so that a test creates the user the docs
 * describe, and the two cannot drift apart). Throws unless exactly one comment matches.
 */
export function documentedAcl(label: string): { user: string; rules: string[] }[] {
  const found: { user: string; rules: string[] }[][] = [];
  for (const file of docFiles()) {
    const text = readFileSync(file, 'utf8');
    for (const block of text.matchAll(/^```\n([\s\S]*?)^```$/gm)) {
      let current: { user: string; rules: string[] }[] | undefined;
      for (const line of (block[1] as string).split('\n')) {
        if (line.startsWith('#')) {
          current = line.includes(label) ? [] : undefined;
          if (current) found.push(current);
          continue;
        }
        const words = line.trim().split(/\s+/);
        if (current && words[0] === 'ACL' && words[1] === 'SETUSER') {
          current.push({ user: words[2] as string, rules: words.slice(3) });
        }
      }
    }
  }
  const [lines, ...others] = found;
  if (!lines || others.length > 0 || lines.length === 0) {
    throw new Error(`the docs have ${found.length} ACL block(s) labelled "${label}"; expected one`);
  }
  return lines;
}

/**
 * The rules of a documented line for a test's own user: its password, and its own key prefix and
 * names in place of the docs' `dedup` and `billing`.
 */
export function forTest(
  rules: string[],
  options: { password: string; prefix?: string; scope?: string },
): string[] {
  return rules.map((rule) => {
    if (rule === '>secret') return `>${options.password}`;
    if (rule === '~dedup:*' && options.prefix) return `~${options.prefix}:*`;
    if (rule === '~{billing}:*' && options.scope) return `~{${options.scope}}:*`;
    return rule;
  });
}

/** What a least-privilege user must be refused; each is tried, and none may get through. */
const MUST_BE_REFUSED: readonly (readonly string[])[] = [
  ['FUNCTION', 'LOAD', "#!lua name=intruder\nredis.register_function('f', function() return 1 end)"],
  ['FUNCTION', 'FLUSH'],
  ['SCAN', '0'],
  ['KEYS', '*'],
  ['DBSIZE'],
  ['RANDOMKEY'],
  ['SCRIPT', 'FLUSH'],
  ['CONFIG', 'GET', 'requirepass'],
  ['FLUSHALL'],
  ['GET', 'not-the-prefix:secret'],
  ['SET', 'not-the-prefix:secret', 'x'],
];

/** The commands of MUST_BE_REFUSED that `call` was not refused (NOPERM) for: [] when all were. */
export async function notRefused(
  call: (command: string, ...args: string[]) => Promise<unknown>,
): Promise<string[]> {
  const through: string[] = [];
  for (const [command, ...args] of MUST_BE_REFUSED) {
    const outcome = await call(command as string, ...args).then(
      () => 'ran',
      (error: Error) => error.message,
    );
    if (!/^NOPERM/.test(outcome)) through.push(`${[command, ...args].join(' ').slice(0, 40)}: ${outcome}`);
  }
  return through;
}

/** The commands Redis's ACL LOG holds refusals of for `user` (a user that needed nothing more has none). */
export function refusalsOf(aclLog: unknown, user: string): string[] {
  const entries = (aclLog as unknown[][]).map((flat) => {
    const entry: Record<string, unknown> = {};
    for (let at = 0; at + 1 < flat.length; at += 2) entry[String(flat[at])] = flat[at + 1];
    return entry;
  });
  return entries
    .filter((entry) => entry.username === user)
    .map((entry) => `${String(entry.reason)} ${String(entry.object)}`);
}

/**
 * The `rabbitmqctl set_permissions` line the docs print under a `# …` comment containing `label`:
 * its configure, write and read regexes, with the docs' example names (`orders`, `orders-in`,
 * `orders-dlx`) replaced by a test's own.
 */
export function documentedPermissions(
  label: string,
  names: { orders?: string; 'orders-in'?: string; 'orders-dlx'?: string },
): { configure: string; write: string; read: string } {
  const found: string[] = [];
  for (const file of docFiles()) {
    for (const block of readFileSync(file, 'utf8').matchAll(/^```\n([\s\S]*?)^```$/gm)) {
      const lines = (block[1] as string).split('\n');
      lines.forEach((line, index) => {
        const next = lines[index + 1] ?? '';
        if (line.startsWith('#') && line.includes(label) && next.startsWith('rabbitmqctl set_permissions'))
          found.push(next);
      });
    }
  }
  const [line, ...others] = found;
  const regexes = line ? [...line.matchAll(/'([^']*)'/g)].map((match) => match[1] as string) : [];
  if (!line || others.length > 0 || regexes.length !== 3) {
    throw new Error(
      `the docs have ${found.length} set_permissions line(s) labelled "${label}"; expected one`,
    );
  }
  const rename = (regex: string) =>
    regex.replace(/orders(-in|-dlx)?/g, (whole) => names[whole as keyof typeof names] ?? whole);
  const [configure, write, read] = regexes.map(rename) as [string, string, string];
  return { configure, write, read };
}
