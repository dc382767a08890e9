import { createRequire } from 'node:module';

// yaml is loaded on first use, not at start: most runs read no file, and loading it cost the
// bridge's start about 40 ms (bench/NOTES.md, "The start").
const require = createRequire(import.meta.url);
const yaml = (): typeof import('yaml') => require('yaml') as typeof import('yaml');

export function parseYaml(text: string): unknown {
  return yaml().parse(text);
}

export function stringifyYaml(value: unknown): string {
  return yaml().stringify(value);
}
