import type { Command } from 'commander';
import { describeConfig, loadConfigFile, resolveConfigRoutes } from '../config/file.js';
import { stringifyYaml } from '../config/yaml.js';
import { ExitCode } from '../errors.js';

/** `dedup-bridge config check <file>`: validate a config file and show what `run` would use. */
export function addConfigCommands(program: Command, setExitCode: (code: number) => void): void {
  const config = program.command('config').description('work with config files (run --config)');
  config
    .command('check <file>')
    .description('validate a config file and print its effective settings, passwords masked')
    .action((path: string) => {
      const file = loadConfigFile(path, 'config check');
      const routes = resolveConfigRoutes(path, file, {}, 'run');
      const summary = `# ${path}: valid, ${routes.length} route${routes.length === 1 ? '' : 's'}`;
      process.stdout.write(`${summary}\n${stringifyYaml(describeConfig(file, routes))}`);
      setExitCode(ExitCode.ok);
    });
}
