import { readdirSync, readFileSync } from 'node:fs';
import { dirname, join, normalize, relative } from 'node:path';
import { describe, expect, it } from 'vitest';

// The layers of docs/development.md, top first; files directly in src/ not listed are the ground
// floor. A file may import its own layer (its folder) and any layer below it.
const LAYERS: readonly (readonly string[])[] = [
  ['src/index.ts'],
  ['src/cli'],
  ['src/migrate'],
  ['src/observe'],
  ['src/bridge', 'src/client'],
  ['src/amqp', 'src/dedup', 'src/stream'],
  ['src/ports.ts'],
  ['src/wire'],
  ['src/config'],
];

function sources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((item) => {
    const path = join(dir, item.name);
    if (item.isDirectory()) return sources(path);
    return path.endsWith('.ts') ? [path] : [];
  });
}

function layerOf(file: string): number {
  const index = LAYERS.findIndex((layer) => layer.some((top) => file === top || file.startsWith(`${top}/`)));
  return index === -1 ? LAYERS.length : index;
}

/** Every relative import of every file under src/, as repository paths of .ts files. */
function importGraph(): Map<string, string[]> {
  const graph = new Map<string, string[]>();
  for (const file of sources('src')) {
    const text = readFileSync(file, 'utf8');
    const targets = [...text.matchAll(/from '(\.[^']+)'/g)].map((match) =>
      relative('.', normalize(join(dirname(file), (match[1] as string).replace(/\.js$/, '.ts')))),
    );
    graph.set(relative('.', file), targets);
  }
  return graph;
}

describe('the layout', () => {
  const graph = importGraph();

  it('imports point down the layers of docs/development.md', () => {
    const upward: string[] = [];
    for (const [file, targets] of graph) {
      for (const target of targets) {
        if (layerOf(target) < layerOf(file)) upward.push(`${file} -> ${target}`);
      }
    }
    expect(graph.size).toBeGreaterThan(50);
    expect(upward).toEqual([]);
  });

  it('no files import each other, directly or round a circle', () => {
    const circles: string[] = [];
    const state = new Map<string, 'open' | 'done'>();
    const path: string[] = [];
    const visit = (file: string) => {
      state.set(file, 'open');
      path.push(file);
      for (const target of graph.get(file) ?? []) {
        if (state.get(target) === 'open')
          circles.push([...path.slice(path.indexOf(target)), target].join(' -> '));
        else if (!state.has(target)) visit(target);
      }
      path.pop();
      state.set(file, 'done');
    };
    for (const file of graph.keys()) if (!state.has(file)) visit(file);
    expect(circles).toEqual([]);
  });
});
