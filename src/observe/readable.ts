// Turns one pino JSON line into a line for a person at a terminal:
//   14:02:07.412 WARN  [orders] target broker at amqp://bridge:***@host:5672/: lost; reconnecting reason="…"

const ESC = String.fromCharCode(27);
const COLOURS: Record<string, string> = {
  fatal: '31',
  error: '31',
  warn: '33',
  info: '32',
  debug: '90',
  trace: '90',
};
// Shown in the fixed part of the line, or not at all.
const OMITTED = new Set(['level', 'time', 'pid', 'hostname', 'route', 'msg']);

function paint(code: string | undefined, text: string): string {
  return code === undefined ? text : `${ESC}[${code}m${text}${ESC}[0m`;
}

function valueText(value: unknown): string {
  if (typeof value === 'string') return /^[^\s"=]+$/.test(value) ? value : JSON.stringify(value);
  return JSON.stringify(value) ?? String(value);
}

export function readableLine(jsonLine: string): string {
  let entry: Record<string, unknown>;
  try {
    entry = JSON.parse(jsonLine) as Record<string, unknown>;
  } catch {
    return jsonLine;
  }
  const level = String(entry.level ?? '');
  const time = typeof entry.time === 'string' ? entry.time.slice(11, 23) : '';
  const parts = [time, paint(COLOURS[level], level.toUpperCase().padEnd(5))];
  if (entry.route !== undefined) parts.push(`[${String(entry.route)}]`);
  if (entry.msg !== undefined) parts.push(String(entry.msg));
  for (const [key, value] of Object.entries(entry)) {
    if (!OMITTED.has(key)) parts.push(`${paint('2', `${key}=`)}${valueText(value)}`);
  }
  return `${parts.filter((part) => part !== '').join(' ')}\n`;
}
