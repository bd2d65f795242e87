"""Print the README's API reference: every public name with the first line of its docstring."""

import inspect
import typing

import lightning_loaders
from lightning_loaders.adapters import dali, ffcv


def _summary(obj: object) -> str:
    if typing.get_origin(obj) is typing.Literal:  # a type alias has no docstring of its own
        return "One of " + ", ".join(f"``{value!r}``" for value in typing.get_args(obj)) + "."
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def main() -> None:
    print("| name | what it is |\n|---|---|")
    for name in lightning_loaders.__all__:
        print(f"| `{name}` | {_summary(getattr(lightning_loaders, name))} |")
    for module, names in ((dali, ["DALILoader", "FileSamples"]),
                          (ffcv, ["FFCVLoader", "write_beton"])):
        for name in names:
            print(f"| `{module.__name__}.{name}` | {_summary(getattr(module, name))} |")


if __name__ == "__main__":
    main()
