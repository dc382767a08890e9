#!/usr/bin/env node
// Thin shim: the CLI lives in src/cli (built to dist/cli).
import { existsSync } from 'node:fs';

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
