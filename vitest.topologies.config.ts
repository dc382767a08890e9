import { defineConfig } from 'vitest/config';
import base from './vitest.config.js';

// Redis Sentinel and Cluster tests start their own Redis servers and wait for failovers, so they
// run apart from the main suite: `npm run test:topologies`. (Not mergeConfig: it would append to
// the main suite's include list instead of replacing it.) They use none of the shared harness's
// servers, so they do not start it.
export default defineConfig({
  ...base,
  test: { ...base.test, include: ['test/topologies/**/*.test.ts'], globalSetup: [] },
});
