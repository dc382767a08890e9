#!/usr/bin/env node
// Thin shim: the CLI lives in src/cli (built to dist/cli).
import { existsSync } from 'node:fs';

// Node 24 lets V8's young generation grow to 128 MiB on a large host, which is most of what a
// bridge under load holds (peak RSS 200-300 MiB against 170 with 16 MiB semi-spaces, at no
// measurable CPU cost). The flag only works from the start, so the process replaces itself once
// with it, keeping its pid, streams and signals; unless a semi-space size was chosen already, or
// this Node cannot (process.execve: Node 22.15+, not on Windows).
const SEMI_SPACE = '--max-semi-space-size';
const chosen = [...process.execArgv, ...(process.env.NODE_OPTIONS ?? '').split(/\s+/)].some((flag) =>
  flag.startsWith(SEMI_SPACE),
);
if (!chosen && typeof process.execve === 'function') {
  process.execve(process.execPath, [
    process.execPath,
    `${SEMI_SPACE}=16`,
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
