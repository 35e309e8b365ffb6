#!/bin/bash
# Runs one_definition.py over every source of //runtime, //device and //mp (see BUILD.bazel).
exec /usr/bin/python3 "$@"
