"""`--help` of `losshead-server` and of `losshead` and its subcommands, against the flags the
binaries register (read from their `--helpfull`, absl's list of every flag, not a list kept here).

- `losshead-server --help` describes every flag defined in server/flags.cc.
- `losshead --help` describes every flag defined in client/cli/flags.cc and names every command.
- For every command C and every registered flag F: `losshead C --F=<its default> --help` exits 0
  when `losshead C --help` describes F (or lists it as a deprecated spelling), and otherwise exits
  2 saying that F is not a flag of C and naming exactly the flags C's help describes.
- An unknown flag, an unknown command and no command exit 2 with the reason.

    help_test.py LOSSHEAD_SERVER LOSSHEAD
"""

import re
import subprocess
import sys


def run(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60)


def registered(binary, source):
    """{flag: default} of the flags `binary --helpfull` lists under a file ending in `source`."""
    out = run(binary, "--helpfull").stdout
    flags, in_source, entry = {}, False, None
    for line in out.splitlines() + [""]:
        header = re.match(r"^  Flags from (.*):$", line)
        start = re.match(r"^    --(\w+) \(", line)
        if entry is not None and (header or start or not line.startswith("      ")):
            name, text = entry
            default = re.search(r"default: (.*);$", text)
            value = default.group(1) if default else ""
            flags[name] = value[1:-1] if value.startswith('"') else value
            entry = None
        if header:
            in_source = header.group(1).endswith(source)
        elif start and in_source:
            entry = (start.group(1), line)
        elif entry is not None:
            entry = (entry[0], entry[1] + " " + line.strip())
    return flags


def described(help_text):
    """The flags a `losshead` help text describes ("  --name (default ...)" and a meaning)."""
    lines = help_text.splitlines()
    names = set()
    for i, line in enumerate(lines):
        m = re.match(r"^  --(\w+) \(default .*\)$", line)
        if m and i + 1 < len(lines) and lines[i + 1].startswith("      ") and lines[i + 1].strip():
            names.add(m.group(1))
    return names


def main(server_bin, cli_bin):
    failures = []

    def expect(ok, what):
        if not ok:
            failures.append(what)

    # The server.
    server_flags = registered(server_bin, "server/flags.cc")
    expect(len(server_flags) > 20, f"losshead-server --helpfull lists {sorted(server_flags)}")
    helped = run(server_bin, "--help")
    listed = set(re.findall(r"^    --(\w+) \(", helped.stdout, re.M))
    expect("No flags matched" not in helped.stdout, "losshead-server --help: No flags matched")
    expect(listed == set(server_flags),
           f"losshead-server --help misses {sorted(set(server_flags) - listed)}, adds "
           f"{sorted(listed - set(server_flags))}")

    # The tool.
    tool_flags = registered(cli_bin, "client/cli/flags.cc")
    expect(len(tool_flags) > 30, f"losshead --helpfull lists {sorted(tool_flags)}")
    top = run(cli_bin, "--help")
    expect(top.returncode == 0, f"losshead --help: exit {top.returncode}")
    deprecated = dict(re.findall(r"^  --(\w+): --(\w+)$", top.stdout, re.M))
    expect(described(top.stdout) | set(deprecated) == set(tool_flags),
           f"losshead --help misses {sorted(set(tool_flags) - described(top.stdout) - set(deprecated))}")
    section = top.stdout.split("commands:\n", 1)[1].split("\n\n", 1)[0]
    commands = re.findall(r"^  (\w+) ", section, re.M)
    expect(len(commands) >= 10, f"commands in losshead --help: {commands}")

    for command in commands:
        helped = run(cli_bin, command, "--help")
        expect(helped.returncode == 0, f"losshead {command} --help: exit {helped.returncode}")
        own = described(helped.stdout)
        own_deprecated = set(re.findall(r"--(\w+): --\w+", helped.stdout.split(
            "deprecated spellings", 1)[1] if "deprecated spellings" in helped.stdout else ""))
        expect(own, f"losshead {command} --help describes no flag")
        for flag, default in sorted(tool_flags.items()):
            probe = run(cli_bin, command, f"--{flag}={default}", "--help")
            if flag in own or flag in own_deprecated:
                expect(probe.returncode == 0,
                       f"losshead {command} --{flag}: its help lists it, yet exit "
                       f"{probe.returncode}: {probe.stderr.strip()!r}")
                continue
            said = re.search(r"takes (.*) \(losshead", probe.stderr)
            takes = set(re.findall(r"--(\w+)", said.group(1))) if said else set()
            expect(probe.returncode == 2 and
                   f"--{flag} is not a flag of `losshead {command}`" in probe.stderr and
                   takes == own,
                   f"losshead {command} --{flag} (not in its help): exit {probe.returncode}, "
                   f"{probe.stderr.strip()!r}")

    for argv, reason in [(["bench", "--bogus=1"], "unknown flag --bogus; `losshead bench` takes"),
                         (["frob"], "unknown command 'frob'"),
                         ([], "no command given"),
                         (["list", "extra"], "unexpected argument 'extra'")]:
        r = run(cli_bin, *argv)
        expect(r.returncode == 2 and reason in r.stderr,
               f"losshead {' '.join(argv)}: exit {r.returncode}, {r.stderr.strip()!r}; expected "
               f"exit 2 and {reason!r}")

    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if failures:
        sys.exit(1)
    print(f"help: {len(server_flags)} server flags, {len(tool_flags)} tool flags over "
          f"{len(commands)} commands as expected")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
