"""The docs site as a reader gets it, and the words that must agree across the README, the site and the Makefile.

- The site builds with ``mkdocs build --strict`` and shows no Sphinx role (``:class:`...```) as raw text:
  ``tools/griffe_sphinx_roles.py`` turns each role into a link, or into code text where the target is not
  rendered. ``make test`` builds the site into .venv/site just before the suite; that build is used when
  it is newer than every source of the site, else the test builds its own.
- The home page's example runs as written, twice (the second run resumes), and prints what the page says.
- The home page links to the quickstart and to every user guide.
- The README and the home page give the same torch install lines; the Makefile uses the same CPU index;
  both list every extra of pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / "docs" / "index.md"
SITE_SOURCES = [ROOT / "mkdocs.yml", ROOT / "docs", ROOT / "tools", ROOT / "tierfs", ROOT / "examples"]
ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):")


def _newest_source() -> float:
    newest = 0.0
    for src in SITE_SOURCES:
        paths = [src] if src.is_file() else [p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        newest = max([newest, *(p.stat().st_mtime for p in paths)])
    return newest


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site: make test's .venv/site when it is up to date, else a strict build of our own."""
    made = ROOT / ".venv" / "site"
    if (made / "index.html").is_file() and (made / "index.html").stat().st_mtime > _newest_source():
        return made
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"mkdocs build --strict failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return out


def visible_text(html: str) -> str:
    """What a reader sees outside code: roles quoted in code (as the development page does) don't count."""
    html = re.sub(r"<(pre|code|script|style)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"<[^>]+>", " ", html)


def test_no_sphinx_role_left_in_the_site(site):
    pages = sorted(site.rglob("*.html"))
    assert (site / "api" / "index.html") in pages
    left = {}
    for page in pages:
        text = visible_text(page.read_text())
        found = [text[max(0, m.start() - 40):m.end() + 40].split() for m in ROLE.finditer(text)]
        if found:
            left[str(page.relative_to(site))] = [" ".join(f) for f in found[:3]]
    assert not left, f"raw Sphinx roles in the built site: {left}"


def test_roles_in_the_api_reference_are_links(site):
    api = (site / "api" / "index.html").read_text()
    links = set(re.findall(r'<a class="autorefs autorefs-internal"[^>]*href="#([\w.]+)"[^>]*><code>([\w.]+)</code></a>',
                           api))
    # the ~ form shows the last component; a bare name resolves in the scope of the documented object
    assert ("tierfs.errors.ArgumentError", "ArgumentError") in links, sorted(links)
    assert ("tierfs.TieredStore.restore", "restore") in links, sorted(links)
    assert len(links) >= 10, sorted(links)
    assert "<autoref" not in api


def _roles_extension():
    spec = importlib.util.spec_from_file_location("griffe_sphinx_roles", ROOT / "tools" / "griffe_sphinx_roles.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_roles_extension_resolves_as_sphinx_reads_them(tmp_path):
    """Each form of role on a small package, through griffe, Markdown and autorefs as the site build runs them."""
    import griffe
    import markdown
    from mkdocs_autorefs import fix_refs

    pkg = tmp_path / "rolepkg"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .core.store import Store\n")
    (pkg / "errors.py").write_text('class BadError(Exception):\n    """Bad."""\n')
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "helpers.py").write_text('"""Helpers."""\n')
    (pkg / "core" / "store.py").write_text('''
from ..errors import BadError


class Store:
    """Raises :class:`~rolepkg.errors.BadError`; see :meth:`load`, :mod:`.helpers`,
    :py:class:`the error <rolepkg.errors.BadError>`, :func:`!nolink` and :class:`Nowhere`."""

    def load(self):
        """Like :meth:`Store.save` (or :meth:`save()`), raising :exc:`BadError` or :class:`rolepkg.errors.BadError`."""

    def save(self):
        """Save."""
''')
    ext = _roles_extension()
    loaded = griffe.load("rolepkg", search_paths=[str(tmp_path)], extensions=griffe.load_extensions(ext.SphinxRoles))

    def ref(identifier: str, title: str) -> str:
        return f'<autoref identifier="{identifier}" optional>`{title}`</autoref>'

    store = loaded["core.store.Store"]
    assert store.docstring.value == (
        f"Raises {ref('rolepkg.errors.BadError', 'BadError')}; see {ref('rolepkg.core.store.Store.load', 'load')}, "
        f"{ref('rolepkg.core.helpers', 'helpers')},\n{ref('rolepkg.errors.BadError', 'the error')}, `nolink` and "
        f"{ref('Nowhere', 'Nowhere')}.")
    assert store.members["load"].docstring.value == (
        f"Like {ref('rolepkg.core.store.Store.save', 'Store.save')} (or {ref('rolepkg.core.store.Store.save', 'save')}), "
        f"raising {ref('rolepkg.errors.BadError', 'BadError')} or "
        f"{ref('rolepkg.errors.BadError', 'rolepkg.errors.BadError')}.")
    assert not ext.ROLE_RE.search(store.docstring.value)

    # rendered: a link where the target is on the site, code text where it is not, and no warning either way
    html = markdown.markdown(store.docstring.value)
    urls = {"rolepkg.errors.BadError": "api/#rolepkg.errors.BadError"}
    out, unmapped = fix_refs(html, lambda identifier: (urls[identifier], None))
    assert unmapped == []
    assert 'href="api/#rolepkg.errors.BadError"><code>BadError</code></a>' in out, out
    assert 'href="api/#rolepkg.errors.BadError"><code>the error</code></a>' in out, out
    assert '<span title="rolepkg.core.store.Store.load"><code>load</code></span>' in out, out
    assert '<span title="Nowhere"><code>Nowhere</code></span>' in out, out
    assert "<autoref" not in out and not ROLE.search(out)


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", path.read_text(), re.S | re.M)


@pytest.fixture
def fresh_user(tmp_path):
    """A user name of the test's own (getpass reads LOGNAME first) and TMPDIR, so /dev/shm/tierfs-*-<user> is
    fresh and nothing of the real user's is touched; removed afterwards."""
    user = f"tierfs-test-{uuid.uuid4().hex[:8]}"
    yield {"LOGNAME": user, "USER": user, "TMPDIR": str(tmp_path)}
    for p in Path("/dev/shm").glob(f"tierfs-*-{user}"):
        shutil.rmtree(p, ignore_errors=True)


def test_home_page_example_runs_and_resumes(fresh_user, tmp_path):
    blocks = python_blocks(INDEX)
    assert len(blocks) == 1, "docs/index.md should have one ```python example"
    script = tmp_path / "home_example.py"
    script.write_text(blocks[0])

    def run() -> list[str]:
        p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**os.environ, **fresh_user},
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"the home page's example failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
        return p.stdout.splitlines()

    first, second = run(), run()
    assert first == ["trained to step 5; steps and the tiers holding them: {4: ['ram'], 5: ['ram', 'file']}"], first
    assert len(second) == 2 and re.match(r"restored step 5 from tier 'ram': ", second[0]), second
    # the output the page shows is this run's, up to the restore's size and timings
    shown = INDEX.read_text().split("The second run prints, e.g.:\n\n```\n", 1)[1].split("```", 1)[0].splitlines()
    assert shown[1] == second[1], (shown, second)
    assert re.sub(r": .*", "", shown[0]) == re.sub(r": .*", "", second[0]), (shown, second)


def test_home_page_links_the_quickstart_and_every_user_guide():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    guides = next(item["User guide"] for item in nav if isinstance(item, dict) and "User guide" in item)
    pages = ["quickstart.md", *(page for entry in guides for page in entry.values())]
    text = INDEX.read_text()
    missing = [p for p in pages if f"]({p})" not in text]
    assert not missing, f"docs/index.md does not link {missing}"
    assert text.index("](quickstart.md)") < text.index("## Compared with what exists")


def _torch_lines(path: Path) -> list[str]:
    blocks = re.findall(r"^```sh\n(.*?)^```$", path.read_text(), re.S | re.M)
    return [line.split("#")[0].strip() for b in blocks for line in b.splitlines() if "pip install torch" in line]


def test_one_install_story():
    readme, home = _torch_lines(ROOT / "README.md"), _torch_lines(INDEX)
    assert readme == home, (readme, home)
    cpu_index = "https://download.pytorch.org/whl/cpu"
    assert readme == [f"python -m pip install torch --index-url {cpu_index}", "python -m pip install torch"], readme
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^TORCH_CPU_INDEX := {re.escape(cpu_index)}$", makefile, re.M), makefile
    assert "--index-url $(TORCH_CPU_INDEX)" in makefile and "+cpu" in makefile

    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([\w-]+) = \[", section, re.M)
    assert {"torch", "s3", "lightning", "transformers", "torchtitan", "dev"} <= set(extras), extras
    for path in (ROOT / "README.md", INDEX):
        listed = re.findall(r"^\| `([\w-]+)` \|", path.read_text(), re.M)
        assert sorted(listed) == sorted(extras), (path.name, listed, extras)
