import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    // The chaos suite and the Redis topology tests have configs of their own
    // (vitest.chaos.config.ts, vitest.topologies.config.ts): they start servers of their own.
    include: ['test/unit/**/*.test.ts', 'test/integration/**/*.test.ts'],
    globalSetup: ['test/harness/global-setup.ts'],
    // The broker tests share servers: one file at a time.
    fileParallelism: false,
    testTimeout: 120_000,
    hookTimeout: 120_000,
    reporters: ['default', './test/summary-reporter.ts'],
  },
});
