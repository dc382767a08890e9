#!/usr/bin/env node
// Thin shim: the CLI lives in src/cli (built to dist/cli).
import { existsSync } from 'node:fs';

// V8's defaults on a large host let a bridge under load hold far more memory than it uses: the
// young generation grows to 128 MiB, and the old one to several times what survived its last
// collection (peak RSS 193-199 MiB in a 100,000-message migrate; with the two settings below
// 137-144 MiB, for 7-19% more CPU in this process; docs/performance.md, Memory). The flags only
// work from the start, so the process replaces itself once with them, keeping its pid, streams and
// signals; a setting the user chose on node's command line (or the semi-space size in NODE_OPTIONS,
// which refuses the other) is kept, and a Node that cannot (process.execve: Node 22.15+, not on
// Windows) runs with its own defaults.
const DEFAULTS = ['--max-semi-space-size=8', '--heap-growing-percent=100'];
// Node takes a V8 flag with underscores too, and NODE_OPTIONS may quote it: compare names as V8 does.
const nameOf = (option) =>
  option
    .replace(/^["']|["']$/g, '')
    .split('=')[0]
    .replaceAll('_', '-');
const given = [...process.execArgv, ...(process.env.NODE_OPTIONS ?? '').split(/\s+/)].map(nameOf);
const missing = DEFAULTS.filter((flag) => !given.includes(nameOf(flag)));
if (missing.length > 0 && typeof process.execve === 'function') {
  process.execve(process.execPath, [
    process.execPath,
    ...missing,
    ...process.execArgv,
    ...process.argv.slice(1),
  ]);
}

const entry = new URL('../dist/cli/main.js', import.meta.url);
if (!existsSync(entry)) {
  process.stderr.write(
    'dedup-bridge: not built yet; run `npm run build` (or `npm ci`) in the package folder\n',
  );
  process.exit(1);
}
const { main } = await import(entry.href);
const code = await main(process.argv);
process.exit(code);
