import { spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { parseAllDocuments } from 'yaml';
import { CLI } from '../helpers.js';

// The example manifests in docs/kubernetes, read as Kubernetes would: every document of every file.

const folder = new URL('../../docs/kubernetes/', import.meta.url);

interface Manifest {
  file: string;
  apiVersion: string;
  kind: string;
  metadata: { name: string };
  // biome-ignore lint/suspicious/noExplicitAny: a manifest is free-form; the tests check its shape.
  spec?: any;
  data?: Record<string, string>;
  stringData?: Record<string, string>;
}

interface Container {
  name: string;
  args: string[];
  env?: { name: string; value?: string; valueFrom?: { secretKeyRef?: { name: string; key: string } } }[];
  ports?: { name?: string; containerPort: number }[];
  livenessProbe?: { httpGet: { path: string; port: number | string } };
  readinessProbe?: { httpGet: { path: string; port: number | string } };
  volumeMounts?: { name: string; mountPath: string }[];
}

interface PodSpec {
  containers: Container[];
  volumes?: { name: string; configMap?: { name: string; items?: { key: string; path: string }[] } }[];
  terminationGracePeriodSeconds?: number;
  automountServiceAccountToken?: boolean;
  securityContext?: { runAsNonRoot?: boolean; seccompProfile?: { type: string } };
}

const API_VERSION: Record<string, string> = {
  Deployment: 'apps/v1',
  CronJob: 'batch/v1',
  ConfigMap: 'v1',
  Secret: 'v1',
  Service: 'v1',
  NetworkPolicy: 'networking.k8s.io/v1',
};

function readManifests(): Manifest[] {
  const manifests: Manifest[] = [];
  for (const file of readdirSync(folder).filter((name) => name.endsWith('.yaml'))) {
    for (const document of parseAllDocuments(readFileSync(new URL(file, folder), 'utf8'))) {
      expect(document.errors, file).toEqual([]);
      manifests.push({ file, ...(document.toJS() as Omit<Manifest, 'file'>) });
    }
  }
  return manifests;
}

/** The long options a command's --help lists. */
function optionsOf(command: string): Set<string> {
  const help = spawnSync(process.execPath, [CLI, command, '--help'], { encoding: 'utf8' });
  expect(help.status, help.stderr).toBe(0);
  return new Set(
    [...help.stdout.matchAll(/^\s+(?:-\w, )?(--[a-z][a-z-]*)/gm)].map((match) => match[1] as string),
  );
}

/** The value after a flag in a container's args. */
function argOf(container: Container, flag: string): string | undefined {
  const index = container.args.indexOf(flag);
  return index >= 0 ? container.args[index + 1] : undefined;
}

/** The ConfigMap key a file path in the container resolves to, through its volume mounts. */
function configMapKeyOf(pod: PodSpec, container: Container, path: string): { map: string; key: string } {
  const mount = container.volumeMounts?.find((item) => path.startsWith(`${item.mountPath}/`));
  expect(mount, `${path} is not on a mounted volume`).toBeDefined();
  const volume = pod.volumes?.find((item) => item.name === mount?.name);
  expect(volume?.configMap, `${path} is not on a ConfigMap volume`).toBeDefined();
  const file = path.slice((mount?.mountPath.length ?? 0) + 1);
  const item = volume?.configMap?.items?.find((entry) => entry.path === file);
  return { map: volume?.configMap?.name as string, key: item?.key ?? file };
}

// A URL with a password in it: `scheme://user:password@host`.
const URL_WITH_PASSWORD = /[a-z]+:\/\/[^\s/:@]*:[^\s/@]+@/;

describe('the Kubernetes manifests in docs/kubernetes', () => {
  const manifests = readManifests();
  const byKind = (kind: string) => manifests.filter((item) => item.kind === kind);
  const workloads: { manifest: Manifest; pod: PodSpec; command: string }[] = [
    ...byKind('Deployment').map((manifest) => ({
      manifest,
      pod: manifest.spec.template.spec,
      command: 'run',
    })),
    ...byKind('CronJob').map((manifest) => ({
      manifest,
      pod: manifest.spec.jobTemplate.spec.template.spec,
      command: 'migrate',
    })),
  ];

  it('are Kubernetes objects of known kinds and API versions, one Deployment and one CronJob', () => {
    for (const manifest of manifests) {
      expect(Object.keys(API_VERSION), manifest.file).toContain(manifest.kind);
      expect(manifest.apiVersion, `${manifest.file}: ${manifest.kind}`).toBe(API_VERSION[manifest.kind]);
      expect(manifest.metadata.name, manifest.file).toMatch(/^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/);
    }
    expect(byKind('Deployment')).toHaveLength(1);
    expect(byKind('CronJob')).toHaveLength(1);
  });

  it('the Deployment runs replicas of `run` with probes on /healthz and /readyz of its --metrics-port', () => {
    const deployment = byKind('Deployment')[0] as Manifest;
    expect(deployment.spec.replicas).toBeGreaterThanOrEqual(2);
    const pod = deployment.spec.template.spec as PodSpec;
    const container = pod.containers[0] as Container;
    expect(container.args[0]).toBe('run');
    const metricsPort = Number(argOf(container, '--metrics-port'));
    expect(metricsPort).toBeGreaterThan(0);
    const portOf = (port: number | string) =>
      typeof port === 'number' ? port : container.ports?.find((item) => item.name === port)?.containerPort;
    expect(container.ports?.map((item) => item.containerPort)).toContain(metricsPort);
    expect(container.livenessProbe?.httpGet.path).toBe('/healthz');
    expect(portOf(container.livenessProbe?.httpGet.port ?? '')).toBe(metricsPort);
    expect(container.readinessProbe?.httpGet.path).toBe('/readyz');
    expect(portOf(container.readinessProbe?.httpGet.port ?? '')).toBe(metricsPort);
    // A stopping pod finishes its in-flight messages (--shutdown-timeout, 30 s) before it is killed.
    expect(pod.terminationGracePeriodSeconds).toBeGreaterThan(30);
    // The metrics Service points at that port.
    for (const service of byKind('Service')) {
      expect(service.spec.selector).toEqual(deployment.spec.selector.matchLabels);
      for (const port of service.spec.ports) expect(portOf(port.targetPort)).toBe(metricsPort);
    }
  });

  it('every pod runs without a service account token, as non-root, under the runtime’s seccomp profile', () => {
    for (const { manifest, pod } of workloads) {
      expect(pod.automountServiceAccountToken, manifest.file).toBe(false);
      expect(pod.securityContext?.runAsNonRoot, manifest.file).toBe(true);
      expect(pod.securityContext?.seccompProfile, manifest.file).toEqual({ type: 'RuntimeDefault' });
    }
  });

  it('NetworkPolicies let in only Prometheus, on the Deployment’s metrics port, and nothing to the CronJob’s pods', () => {
    const policies = byKind('NetworkPolicy');
    const policyFor = (labels: Record<string, string>) =>
      policies.filter((policy) =>
        Object.entries(policy.spec.podSelector.matchLabels ?? {}).every(
          ([key, value]) => labels[key] === value,
        ),
      );
    const deployment = byKind('Deployment')[0] as Manifest;
    const [bridge, ...otherBridge] = policyFor(deployment.spec.template.metadata.labels);
    expect(otherBridge).toEqual([]);
    expect(bridge?.spec.policyTypes).toEqual(['Ingress']);
    const container = (deployment.spec.template.spec as PodSpec).containers[0] as Container;
    const metricsPort = container.ports?.find(
      (port) => port.containerPort === Number(argOf(container, '--metrics-port')),
    );
    expect(bridge?.spec.ingress).toHaveLength(1);
    const [rule] = bridge?.spec.ingress ?? [];
    expect(rule.ports).toEqual([{ protocol: 'TCP', port: metricsPort?.name }]);
    // Each peer names the pods it lets in (no empty selector, which would let in everything).
    for (const peer of rule.from) expect(Object.keys(peer.podSelector?.matchLabels ?? {})).not.toEqual([]);
    const cronJob = byKind('CronJob')[0] as Manifest;
    const [migrate, ...otherMigrate] = policyFor(cronJob.spec.jobTemplate.spec.template.metadata.labels);
    expect(otherMigrate).toEqual([]);
    expect(migrate?.spec.policyTypes).toEqual(['Ingress']);
    expect(migrate?.spec.ingress).toEqual([]);
  });

  it('the CronJob runs `migrate` and never two at once', () => {
    const cronJob = byKind('CronJob')[0] as Manifest;
    expect(cronJob.spec.concurrencyPolicy).toBe('Forbid');
    const pod = cronJob.spec.jobTemplate.spec.template.spec as PodSpec;
    expect(pod.containers[0]?.args[0]).toBe('migrate');
  });

  it('every --flag in the containers’ args is an option of its command', () => {
    for (const { manifest, pod, command } of workloads) {
      const options = optionsOf(command);
      for (const container of pod.containers) {
        expect(container.args[0], manifest.file).toBe(command);
        for (const arg of container.args.filter((item) => item.startsWith('--'))) {
          expect(options, `${manifest.file}: ${command} ${arg}`).toContain(arg);
        }
      }
    }
  });

  it('URLs with passwords come from the Secret; files come from the ConfigMap', () => {
    const secrets = new Map(
      byKind('Secret').map((secret) => [secret.metadata.name, secret.stringData ?? secret.data ?? {}]),
    );
    const configMaps = new Map(byKind('ConfigMap').map((map) => [map.metadata.name, map.data ?? {}]));
    for (const { manifest, pod } of workloads) {
      for (const container of pod.containers) {
        for (const arg of container.args) expect(arg, manifest.file).not.toMatch(URL_WITH_PASSWORD);
        const names = (container.env ?? []).map((item) => item.name);
        expect(names, manifest.file).toEqual(
          expect.arrayContaining(['DEDUP_BRIDGE_SOURCE', 'DEDUP_BRIDGE_TARGET', 'DEDUP_BRIDGE_REDIS']),
        );
        for (const variable of container.env ?? []) {
          // Every URL variable is a reference to a key that the Secret has, never a literal value.
          expect(variable.value, `${manifest.file}: ${variable.name}`).toBeUndefined();
          const ref = variable.valueFrom?.secretKeyRef;
          expect(ref, `${manifest.file}: ${variable.name}`).toBeDefined();
          expect(
            Object.keys(secrets.get(ref?.name ?? '') ?? {}),
            `${manifest.file}: ${variable.name}`,
          ).toContain(ref?.key);
        }
        for (const flag of ['--config', '--job-file']) {
          const path = argOf(container, flag);
          if (path === undefined) continue;
          const { map, key } = configMapKeyOf(pod, container, path);
          expect(Object.keys(configMaps.get(map) ?? {}), `${manifest.file}: ${flag} ${path}`).toContain(key);
        }
      }
    }
    for (const [name, data] of configMaps) {
      for (const [key, text] of Object.entries(data)) {
        expect(text, `ConfigMap ${name} ${key}`).not.toMatch(URL_WITH_PASSWORD);
        // Each file parses as YAML (the CLI validates it in full).
        expect(parseAllDocuments(text).flatMap((document) => document.errors)).toEqual([]);
      }
    }
  });
});

describe('the ConfigMap’s files', () => {
  const byKind = (kind: string) => readManifests().filter((item) => item.kind === kind);
  it('bridge.yaml is a config file that `config check` accepts', () => {
    const data = (byKind('ConfigMap')[0] as Manifest).data ?? {};
    const dir = mkdtempSync(join(tmpdir(), 'k8s-config-'));
    const file = join(dir, 'bridge.yaml');
    writeFileSync(file, data['bridge.yaml'] ?? '');
    const check = spawnSync(process.execPath, [CLI, 'config', 'check', file], { encoding: 'utf8' });
    expect(check.stderr).toBe('');
    expect(check.status).toBe(0);
    expect(check.stdout).toContain('name: orders');
  });
});
