# Tests of the package as users get it (included by the top level with the tests):
#   benchmarks_doc   docs/BENCHMARKS.md is what benchmarks/plot.py makes of docs/data (not stale).
#   python_logging   library messages reach logging.getLogger("deferalloc") (label torch).
#   pip_install      scripts/pip_check.sh: `pip install .` into a fresh venv, then a deferred
#                    tensor with no environment variable set (labels pip, torch).
#   no_toolkit_build a build without the CUDA toolkit (scripts/no_toolkit_check.sh).
#   readme_examples  the marked examples of README.md and of every docs page, and the commands
#                    of the example programs' docstrings (scripts/readme_examples.py): Python ones
#                    in that venv, C++ ones built against an install of this build tree, on
#                    the host driver; readme_examples_gpu runs them on the GPU (label gpu).
# The consumer project (tests/consumer, one program per exported target) is the
# install_consumer test of tests/CMakeLists.txt.
find_program(DFA_PYTHON3 NAMES python3)
if(DFA_PYTHON3)
  # Regenerates docs/BENCHMARKS.md from docs/data/*/*.json and the template (no matplotlib
  # needed) and fails when the committed file differs or a plot it shows is missing.
  add_test(NAME benchmarks_doc COMMAND ${DFA_PYTHON3} ${PROJECT_SOURCE_DIR}/benchmarks/plot.py --check
           --data ${PROJECT_SOURCE_DIR}/docs/data --template ${PROJECT_SOURCE_DIR}/docs/benchmarks.template.md
           --doc ${PROJECT_SOURCE_DIR}/docs/BENCHMARKS.md --img ${PROJECT_SOURCE_DIR}/docs/img)
endif()
# A build without the CUDA toolkit (scripts/no_toolkit_check.sh): configure, build the
# libraries and the demo, run it; with torch also the README's CPU quick start and a step.
add_test(NAME no_toolkit_build COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/no_toolkit_check.sh
         ${PROJECT_BINARY_DIR}/no-toolkit ${DEFERALLOC_PYTHON})
set_tests_properties(no_toolkit_build PROPERTIES TIMEOUT 900)
if(NOT DEFERALLOC_WITH_TORCH)
  return()  # the Python face imports torch
endif()
set(dfa_pip_work ${PROJECT_BINARY_DIR}/pip-check)
add_test(NAME pip_install COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/pip_check.sh ${dfa_pip_work} ${DEFERALLOC_PYTHON})
set_tests_properties(pip_install PROPERTIES LABELS "pip;torch" TIMEOUT 1200 FIXTURES_SETUP pip_venv)

# Every page's code blocks (docs/*.md: each must be marked) and the commands in the example
# programs' docstrings (the CPU ones here, the GPU ones in readme_examples_gpu).
file(GLOB dfa_doc_pages ${PROJECT_SOURCE_DIR}/docs/*.md)
file(GLOB dfa_example_programs ${PROJECT_SOURCE_DIR}/examples/python/*.py ${PROJECT_SOURCE_DIR}/examples/megatron/*.py)
set(dfa_readme_cmd ${DEFERALLOC_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/readme_examples.py
    --readme ${PROJECT_SOURCE_DIR}/README.md ${dfa_doc_pages} --docstrings ${dfa_example_programs}
    --python ${dfa_pip_work}/v/bin/python --build ${PROJECT_BINARY_DIR} --generator ${CMAKE_GENERATOR})
add_test(NAME readme_examples COMMAND ${dfa_readme_cmd} --work ${PROJECT_BINARY_DIR}/readme-host --driver host)
add_test(NAME readme_examples_gpu COMMAND ${dfa_readme_cmd} --work ${PROJECT_BINARY_DIR}/readme-gpu --driver cuda)
set_tests_properties(readme_examples PROPERTIES LABELS "pip;torch" TIMEOUT 900 FIXTURES_REQUIRED pip_venv)
set_tests_properties(readme_examples_gpu PROPERTIES LABELS "pip;torch;gpu" TIMEOUT 900 FIXTURES_REQUIRED pip_venv
                     SKIP_RETURN_CODE 77)
# A megatron-core kept outside the interpreter (DEFERALLOC_MEGATRON_PATH, as the Megatron tests
# take it) reaches the pip venv too, so that the Megatron pages' and examples' commands run
# instead of being skipped as "megatron.core is not importable".
if(DEFERALLOC_MEGATRON_PATH)
  set_tests_properties(readme_examples readme_examples_gpu PROPERTIES ENVIRONMENT "PYTHONPATH=${DEFERALLOC_MEGATRON_PATH}")
endif()

# The library's log messages in Python's logging (python/deferalloc/_logging.py).
add_test(NAME python_logging COMMAND ${DEFERALLOC_PYTHON} ${PROJECT_SOURCE_DIR}/tests/packaging/test_logging.py)
set_tests_properties(python_logging PROPERTIES LABELS torch TIMEOUT 300 ENVIRONMENT
  "DEFERALLOC_CONF=driver:host,host_granularity_kb:64;DEFERALLOC_LIB=$<TARGET_FILE:deferalloc>;PYTHONPATH=${PROJECT_SOURCE_DIR}/python")
