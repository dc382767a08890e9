import { readFileSync } from 'node:fs';
import { z } from 'zod';
import { ConfigError } from '../errors.js';

// URLs carry passwords, and a flag's value is visible to every user of the host (`ps`). So each URL
// can also come from a file (a mounted Kubernetes or Docker secret) or another variable: the
// `<VARIABLE>_FILE` variables, and `{ file: … }` / `{ env: … }` in place of a URL in a config file.

/** The variables that hold a URL, each of which may instead name a file with `<NAME>_FILE`. */
export const FILE_VARIABLES = [
  'DEDUP_BRIDGE_SOURCE',
  'DEDUP_BRIDGE_TARGET',
  'DEDUP_BRIDGE_REDIS',
  'DEDUP_BRIDGE_SOURCE_MANAGEMENT',
] as const;

/**
 * A secret file's text without its one trailing newline (what `echo` and most editors add). A
 * problem is one line naming `what` and the path, never the content.
 */
export function readSecretFile(path: string, what: string): string {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code ?? 'unreadable';
    throw new ConfigError(
      `${what}: cannot read "${path}" (${code}); give a readable file that holds the URL`,
    );
  }
  const value = text.replace(/\r?\n$/, '');
  if (value.trim() === '') throw new ConfigError(`${what}: "${path}" is empty; it should hold the URL`);
  return value;
}

const fileReference = z.object({ file: z.string().min(1, 'must be the path of a file') }).strict();
const envReference = z
  .object({ env: z.string().regex(/^[A-Za-z_][A-Za-z0-9_]*$/, 'must be the name of a variable') })
  .strict();

/**
 * A text with every occurrence of `secret` replaced by `instead`: for a line about a value read from
 * a secret file or variable, which may hold a bare password by mistake rather than a URL (a URL's
 * own password is masked anyway).
 */
export function withoutValue(text: string, secret: string, instead: string): string {
  return secret === '' ? text : text.split(secret).join(instead);
}

/**
 * A config file's URL field: the URL itself, `{ file: /run/secrets/x }` (its text, one trailing
 * newline dropped) or `{ env: NAME }` (that variable's value); then checked by `url`. A value read
 * by reference that `url` refuses is not quoted in the refusal (see withoutValue). With
 * `plain: 'later'`, a URL written out is left to be checked later (a job file's, which flags may
 * override).
 */
export function urlOrReference<T extends z.ZodType<string, string>>(
  url: T,
  plain: 'check' | 'later' = 'check',
) {
  const checked = (found: string, where: string | undefined, ctx: z.RefinementCtx): string => {
    const result = url.safeParse(found);
    if (result.success) return found;
    for (const issue of result.error.issues) {
      const message =
        where === undefined ? issue.message : withoutValue(issue.message, found, `the URL in ${where}`);
      ctx.addIssue({ code: 'custom', message, path: [...issue.path] });
    }
    return z.NEVER;
  };
  return z.unknown().transform((value, ctx): string => {
    if (typeof value === 'string') return plain === 'check' ? checked(value, undefined, ctx) : value;
    const fromFile = fileReference.safeParse(value);
    if (fromFile.success) {
      try {
        const found = readSecretFile(fromFile.data.file, 'file');
        return checked(found, fromFile.data.file, ctx);
      } catch (error) {
        // "…url.file: cannot read …": the path of the field is put in front by the caller.
        ctx.addIssue({ code: 'custom', path: ['file'], message: stripWhat(error) });
        return z.NEVER;
      }
    }
    const fromEnv = envReference.safeParse(value);
    if (fromEnv.success) {
      const found = process.env[fromEnv.data.env];
      if (found === undefined || found === '') {
        ctx.addIssue({
          code: 'custom',
          path: ['env'],
          message: `the variable ${fromEnv.data.env} is not set (or empty); set it to the URL`,
        });
        return z.NEVER;
      }
      return checked(found, `$${fromEnv.data.env}`, ctx);
    }
    const keys = value !== null && typeof value === 'object' ? Object.keys(value) : [];
    const detail = keys.length > 0 ? ` (got the key${keys.length > 1 ? 's' : ''} ${keys.join(', ')})` : '';
    ctx.addIssue({
      code: 'custom',
      message: `must be a URL, { file: <path> } or { env: <VARIABLE> }${detail}`,
    });
    return z.NEVER;
  });
}

function stripWhat(error: unknown): string {
  return (error as Error).message.replace(/^file: /, '');
}
