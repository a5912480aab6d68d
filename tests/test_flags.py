"""Every flag of every script passes through torchrun untouched. torchrun's own parser
(torch.distributed.run.get_args_parser) reads abbreviations anywhere on the command line (argparse's
allow_abbrev): a flag of ours that is a prefix of one of torchrun's options, as geometry.py's old `--n` was of
--nnodes, --nproc-per-node, ..., stops `torchrun ... script.py --n 40` with "ambiguous option" before the script
runs (or is taken by torchrun, where the prefix is unique). The flags are read from each script's own parsers."""
import argparse
import importlib

import pytest
from torch.distributed.run import get_args_parser

SCRIPTS = {'train_cifar': ['get_args'], 'train_imagenet': ['get_args'], 'train_contrastive': ['get_args'],
           'geometry': ['get_args'], 'robustness': ['get_args', 'compare'], 'bench': ['get_args']}
TORCHRUN = {o for a in get_args_parser()._actions for o in a.option_strings} - {'-h', '--help'}


class Parsed(Exception):  # carries the parser a script built, instead of parsing
    pass


def parsers(p):  # a parser and its sub-commands' parsers
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for s in a.choices.values():
                yield from parsers(s)


def script_flags(name, monkeypatch):
    def grab(self, *args, **kw):
        raise Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, 'parse_args', grab)
    monkeypatch.setattr(argparse.ArgumentParser, 'parse_known_args', grab)
    flags = set()
    for fn in SCRIPTS[name]:
        with pytest.raises(Parsed) as got:
            getattr(importlib.import_module(name), fn)([])
        flags |= {o for p in parsers(got.value.args[0]) for a in p._actions for o in a.option_strings}
    return flags - {'-h', '--help'}


@pytest.mark.parametrize('name', sorted(SCRIPTS))
def test_no_flag_is_a_prefix_of_a_torchrun_option(name, monkeypatch):
    flags = script_flags(name, monkeypatch)
    assert len(flags) >= 10  # (the parsers were found)
    clash = {f: sorted(t for t in TORCHRUN if t.startswith(f)) for f in flags if any(t.startswith(f) for t in TORCHRUN)}
    assert not clash, clash
    monkeypatch.undo()
    parser = get_args_parser()
    for flag in sorted(flags):  # and torchrun's parser hands each one to the script as it was written
        assert parser.parse_args(['--nproc_per_node', '2', f'{name}.py', flag, '1']).training_script_args == [flag, '1']


def test_the_check_catches_the_old_n():
    assert any(t.startswith('--n') for t in TORCHRUN)
    with pytest.raises(SystemExit):
        get_args_parser().parse_args(['--nproc_per_node', '2', 'geometry.py', 'hessian', '--n', '40'])
