import { defineConfig, mergeConfig } from 'vitest/config';
import base from './vitest.config.js';

// Redis Sentinel and Cluster tests start their own Redis servers and wait for failovers, so they
// run apart from the main suite: `npm run test:topologies`.
export default mergeConfig(base, defineConfig({ test: { include: ['test/topologies/**/*.test.ts'] } }));
