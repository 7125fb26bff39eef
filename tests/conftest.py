"""Session-wide test setup."""

from tests.fixtures.triton_interpret import use_interpreter_without_cuda

# Must run before anything imports triton (see tests/fixtures/triton_interpret.py).
use_interpreter_without_cuda()
