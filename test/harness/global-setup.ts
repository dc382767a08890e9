import type {} from 'vitest';
import type { TestProject } from 'vitest/node';
import { type Harness, startHarness } from './harness.js';

declare module 'vitest' {
  export interface ProvidedContext {
    harness: {
      sourceUrl: string;
      targetUrl: string;
      targetStreamUrl: string;
      sourceStreamUrl: string;
      redisUrl: string;
      sourceManagementUrl: string;
      own: boolean;
      runDir: string;
    };
  }
}

let harness: Harness | undefined;

export async function setup(project: TestProject): Promise<void> {
  const started = Date.now();
  harness = await startHarness();
  project.provide('harness', {
    sourceUrl: harness.sourceUrl,
    targetUrl: harness.targetUrl,
    targetStreamUrl: harness.targetStreamUrl,
    sourceStreamUrl: harness.sourceStreamUrl,
    redisUrl: harness.redisUrl,
    sourceManagementUrl: harness.sourceManagementUrl,
    own: harness.own,
    runDir: harness.runDir,
  });
  const how = harness.own ? 'started its own servers' : 'uses SOURCE_URL, TARGET_URL and REDIS_URL';
  process.stdout.write(`harness: ${how} in ${((Date.now() - started) / 1000).toFixed(1)}s\n`);
}

export async function teardown(): Promise<void> {
  await harness?.stop();
}
