import { defineConfig } from 'vitest/config';
import base from './vitest.config.js';

// Redis Sentinel and Cluster tests start their own Redis servers and wait for failovers, so they
// run apart from the main suite: `npm run test:topologies`. (Not mergeConfig: it would append to
// the main suite's include list instead of replacing it.) They use the shared harness's brokers,
// so they keep its global setup.
export default defineConfig({ ...base, test: { ...base.test, include: ['test/topologies/**/*.test.ts'] } });
