"""The documentation: README.md is a front page over the topic pages in docs/ (issue 43).

Every relative link and #anchor in README.md and docs/*.md must resolve, with GitHub's rules for heading anchors
(written out below: the oracle is GitHub's documented behaviour, not code of this repo); README.md stays a front page
(at most ~400 lines); and the test command it gives is the one CI (.ci/run) runs."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_README_LINES = 400


def docs():
    return [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]


def prose(text):
    """The text outside fenced code blocks, one string per line (fenced lines blanked, so line numbers hold)."""
    out, fence = [], None
    for line in text.split('\n'):
        m = re.match(r'^\s*(```+|~~~+)', line)
        if m and (fence is None or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = None if fence else m.group(1)
            out.append('')
            continue
        out.append('' if fence else line)
    return out


def slug(heading):
    """GitHub's anchor for a heading's text: markup dropped (code spans keep their text, a link its label),
    lower case, every character that is not a letter, digit, '_', '-' or space removed, spaces to '-'."""
    text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading)      # [label](url) -> label
    text = re.sub(r'<[^>]+>', '', text)                                # inline HTML tags
    text = text.replace('`', '').replace('*', '')
    text = text.strip().lower()
    text = ''.join(c for c in text if c.isalnum() or c in '_- ')
    return text.replace(' ', '-')


def anchors(path):
    """Every heading's anchor in a markdown file; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen, out = {}, set()
    for line in prose(path.read_text()):
        m = re.match(r'^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$', line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f'{base}-{n}')
    return out


def links(path):
    """(line number, target) of every inline link and image outside code (fences and `code spans`)."""
    for i, line in enumerate(prose(path.read_text()), 1):
        line = re.sub(r'(`+).*?\1', '', line)
        for m in re.finditer(r'!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)', line):
            yield i, m.group(1)


def broken_links(files):
    """One line per link that does not resolve: a missing file or folder, or an anchor no heading has."""
    bad = []
    for path in files:
        for i, target in links(path):
            if re.match(r'^[a-z][a-z0-9+.-]*:', target, re.I):      # http:, https:, mailto: ...: not ours
                continue
            file, _, anchor = target.partition('#')
            dest = (path.parent / file).resolve() if file else path
            where = f'{path.parent.name + "/" if path.parent.name == "docs" else ""}{path.name}:{i}'
            if not dest.exists():
                bad.append(f'{where}: {target}: no such file')
            elif anchor and dest.suffix == '.md' and anchor not in anchors(dest):
                bad.append(f'{where}: {target}: no heading with anchor #{anchor} in {dest.name}')
            elif anchor and dest.suffix != '.md' and not re.fullmatch(r'L\d+(-L\d+)?', anchor):
                bad.append(f'{where}: {target}: an anchor into a file that is not markdown')
    return bad


def test_every_relative_link_and_anchor_resolves():
    assert (REPO / 'docs').is_dir()
    assert broken_links(docs()) == []


def test_the_checker_finds_a_broken_link_and_a_broken_anchor(tmp_path):
    """The check above would pass on anything if the checker saw no links: plant each kind of break."""
    (tmp_path / 'docs').mkdir()
    page = tmp_path / 'docs' / 'page.md'
    page.write_text('# A page: its `commands` (GPU, 8×)\n\n## Measured\n\n## Measured\n\n'
                    '```bash\n# not a heading\n[not a link](nowhere.md)\n```\n')
    readme = tmp_path / 'README.md'
    good = ('[page](docs/page.md) [top](docs/page.md#a-page-its-commands-gpu-8) [second](docs/page.md#measured-1) '
            '[self](#front) [web](https://example.org/x.md) `[code](nowhere.md)`\n\n# Front\n')
    readme.write_text(good)
    assert broken_links([readme, page]) == []
    for wrong in ('[gone](docs/gone.md)', '[typo](docs/page.md#measured-2)', '[case](docs/page.md#Measured)',
                  '[here](#not-here)', '![figure](docs/missing.png)', '[comment](docs/page.md#not-a-heading)'):
        readme.write_text(good + wrong + '\n')
        assert len(broken_links([readme, page])) == 1, wrong


@pytest.mark.parametrize('heading, anchor', [
    ('GSAM (`sam.GSAM`, `--gsam-alpha`, `--rho-min`)', 'gsam-samgsam---gsam-alpha---rho-min'),
    ("The paper's Table 1 at home (ImageNet; estimates, not measured)",
     'the-papers-table-1-at-home-imagenet-estimates-not-measured'),
    ('On a GPU: `gpu_check.py`', 'on-a-gpu-gpu_checkpy'),
    ('Measured: λ_max', 'measured-λ_max'),
])
def test_slug_follows_github(heading, anchor):
    """Anchors as github.com renders them for these headings (checked by hand against GitHub's rules)."""
    assert slug(heading) == anchor


def test_readme_is_a_front_page():
    n = len((REPO / 'README.md').read_text().splitlines())
    assert n <= MAX_README_LINES, f'README.md has {n} lines: move the detail to a page in docs/'


def test_readme_gives_the_test_command_that_ci_runs():
    ci = [line.strip() for line in (REPO / '.ci' / 'run').read_text().splitlines()
          if re.match(r'\s*python -m pytest\b', line)]
    assert len(ci) == 1, ci
    readme = (REPO / 'README.md').read_text().split('\n')
    code = [a.strip() for a, b in zip(readme, prose('\n'.join(readme))) if a != b and not a.lstrip().startswith('```')]
    assert ci[0] in code, f'README.md does not give the test command CI runs: {ci[0]}'
