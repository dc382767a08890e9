import { defineConfig } from 'vitest/config';

// The stream-target review's attack tests (test/review): each file starts its own throwaway nodes,
// so no global harness. Run: npx vitest run --config vitest.review.config.ts [file]
export default defineConfig({
  test: {
    include: ['test/review/**/*.test.ts'],
    fileParallelism: false,
    testTimeout: 300_000,
    hookTimeout: 180_000,
  },
});
