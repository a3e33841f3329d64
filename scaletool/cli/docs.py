"""``scaletool docs``: the documentation pages shipped with scaletool, printed as Markdown."""
from __future__ import annotations

import click


def _title(path) -> str:
    """A page's first Markdown heading, without its ``#`` marks."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return ""


@click.command()
@click.argument("topic", required=False)
def docs(topic: str | None):
    """Print the documentation page TOPIC (Markdown) to stdout; without TOPIC,
    list the topics with their titles.

    The pages ship with scaletool, so they are here after a wheel install
    too; pipe a page to a pager or a Markdown viewer.

    \b
    Examples:
      scaletool docs
      scaletool docs plan | less
      scaletool docs recipes > recipes.md
    """
    from scaletool.resources import doc_page, doc_pages

    if topic is None:
        pages = doc_pages()
        pad = max(map(len, pages), default=0) + 2
        for name, path in pages.items():
            click.echo(f"{name.ljust(pad)}{_title(path)}")
        click.echo("`scaletool docs TOPIC` prints one.")
        return
    click.echo(doc_page(topic).read_text(encoding="utf-8"), nl=False)
