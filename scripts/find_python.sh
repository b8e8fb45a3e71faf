#!/usr/bin/env bash
# Print the path of a Python of version $1 (e.g. 3.12): pythonX.Y on PATH if it runs, else pyenv's newest
# X.Y.*; print nothing (exit 1) when there is none.
v=$1
if command -v "python$v" >/dev/null 2>&1 && "python$v" -c '' >/dev/null 2>&1; then
  command -v "python$v"; exit 0
fi
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for p in $(ls -d "$root/versions/$v".* 2>/dev/null | sort -V -r); do
  [ -x "$p/bin/python$v" ] && { echo "$p/bin/python$v"; exit 0; }
done
exit 1
