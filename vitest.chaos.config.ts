import { defineConfig } from 'vitest/config';
import base from './vitest.config.js';

// The chaos suite starts throwaway brokers and Redis servers of its own (test/chaos/world.ts), so
// it has no use for the shared harness: without it, it starts no servers nobody talks to while it
// runs beside the main suite.
export default defineConfig({
  ...base,
  test: { ...base.test, include: ['test/chaos/**/*.test.ts'], globalSetup: [] },
});
