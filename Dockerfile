# syntax=docker/dockerfile:1

# --- build: install everything and compile TypeScript to dist/ ---
# Node 24 LTS, the exact release CI tests on (.ci/run).
FROM node:24.22.3-bookworm-slim AS build
WORKDIR /app
COPY package.json package-lock.json tsconfig.json tsconfig.build.json ./
COPY src ./src
COPY bin ./bin
# `npm ci` runs the `prepare` script, which runs `npm run build` (tsc + the Lua scripts) into dist/.
RUN npm ci

# --- runtime: production dependencies, the compiled code and the bin shim only ---
FROM node:24.22.3-bookworm-slim
ENV NODE_ENV=production
WORKDIR /app
COPY package.json package-lock.json ./
# --ignore-scripts: `prepare` would try to build, and the build tools are dev dependencies.
RUN npm ci --omit=dev --ignore-scripts && npm cache clean --force
COPY --from=build /app/dist ./dist
COPY --from=build /app/bin ./bin
USER node
ENTRYPOINT ["node", "bin/dedup-bridge.js"]
CMD ["run"]
