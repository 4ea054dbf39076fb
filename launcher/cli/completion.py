"""``-sc install=bash|zsh|fish``, ``uninstall=...``, ``query=...``: tab completion of overrides.

Hydra's own completion scripts only know ``python app.py`` and installed apps, not ``python -m
package.module``. These scripts register on the Python interpreter and, when its second word is
``-m`` and the third one of trainwright's entry points, ask that entry point for candidates
(``python -m launcher.train -sc query=bash`` with ``COMP_LINE`` set); the candidates come from
Hydra's completion code (config groups and their options, keys and values of the composed config).
One install covers all entry points. Install:  eval "$(python -m launcher.train -sc install=bash)"
"""

from __future__ import annotations

import os
import re
import sys

from omegaconf import OmegaConf

from launcher.cli.app import CONFIG_NAME

SHELLS = ("bash", "zsh", "fish")
COMMANDS = ("install", "uninstall", "query")

BASH = """export _TRAINWRIGHT_OLD_COMP=$(complete -p {python} 2> /dev/null)
trainwright_bash_completion()
{{
    local words=($COMP_LINE)
    if (( ${{#words[@]}} < 3 )) || [ "${{words[1]}}" != "-m" ]; then
        return
    fi
    case "${{words[2]}}" in
        {modules}) ;;
        *) return ;;
    esac
    local choices=$( COMP_POINT=$COMP_POINT COMP_LINE=$COMP_LINE ${{words[0]}} -m ${{words[2]}} \\
        -sc query=bash 2> /dev/null )
    local word=${{words[$COMP_CWORD]}}
    COMPREPLY=($( compgen -o nospace -o default -W "$choices" -- "$word" ));
}}

COMP_WORDBREAKS=${{COMP_WORDBREAKS//=}}
COMP_WORDBREAKS=$COMP_WORDBREAKS complete -o nospace -o default -F trainwright_bash_completion \\
    {python}"""
"""Bash script (Hydra's, keyed on ``python -m <entry point>``); zsh runs it through bashcompinit."""

BASH_UNINSTALL = """unset -f trainwright_bash_completion
complete -r {python} 2> /dev/null
eval "$_TRAINWRIGHT_OLD_COMP"
unset _TRAINWRIGHT_OLD_COMP"""

FISH = """function trainwright_fish_completion
    set -lx COMP_LINE (commandline -cp)
    set -l parts (commandline -cpo)
    eval "$parts[1] -m $parts[3] -sc query=fish"
end
{registrations}"""

FISH_UNINSTALL = """{erase}
functions -e trainwright_fish_completion"""


def pythons() -> list[str]:
    """Interpreter names to complete on: python, python3 and this interpreter's name."""
    names = ["python", "python3", os.path.basename(sys.executable)]
    return sorted(set(names), key=names.index)


def script(command: str, shell: str, entry_points: tuple[str, ...]) -> str:
    """The install or uninstall script for ``shell``."""
    python = " ".join(pythons())
    if shell == "fish":
        if command == "uninstall":
            return FISH_UNINSTALL.format(erase="\n".join(f"complete -e -c {p}" for p in pythons()))
        condition = f"__fish_seen_subcommand_from {' '.join(entry_points)}"
        return FISH.format(registrations="\n".join(
            f"complete -c {p} -n '{condition}' -x -a '(trainwright_fish_completion)'"
            for p in pythons()))
    if command == "uninstall":
        return BASH_UNINSTALL.format(python=python)
    text = BASH.format(python=python, modules="|".join(entry_points))
    return ("autoload -Uz bashcompinit && bashcompinit\n" + text) if shell == "zsh" else text


def query(hydra, shell: str) -> str:
    """Candidates for the word at the end of ``$COMP_LINE``, from Hydra's completion code."""
    from hydra._internal.core_plugins.bash_completion import BashCompletion

    line = re.sub(r"^\s*\S+\s+-m\s+\S+", "", os.environ.get("COMP_LINE", ""), count=1).lstrip()
    found = BashCompletion(hydra.config_loader)._query(config_name=CONFIG_NAME, line=line)
    return ("\n" if shell == "fish" else " ").join(found)


def parse_request(overrides: list[str]) -> tuple[str, str]:
    """(command, shell) of ``-sc <command>=<shell>``; ValueError with the usage otherwise."""
    usage = (f"--shell-completion takes one of {', '.join(c + '=SHELL' for c in COMMANDS)} "
             f"(SHELL: {', '.join(SHELLS)}), e.g. -sc install=bash")
    try:
        request = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
    except Exception:
        raise ValueError(usage) from None
    command, shell = next(iter(request.items()), (None, None))
    if len(request) != 1 or command not in COMMANDS or shell not in SHELLS:
        raise ValueError(usage)
    return command, shell


def shell_completion(hydra, request: tuple[str, str], entry_points: tuple[str, ...]) -> None:
    """Print what ``-sc <command>=<shell>`` asks for (a script, or the candidates of a query)."""
    command, shell = request
    print(query(hydra, shell) if command == "query" else script(command, shell, entry_points))
