# The distributed optimizer's tests, when NCCL was found (optimizer/distributed/distributed.cmake).
#   test_distributed.host      ranks as threads on host drivers (CI)
#   test_distributed.cuda      one GPU, NCCL at world size 1        (label gpu)
#   test_distributed.nccl2     two GPUs, one thread per GPU, NCCL    (label multigpu)
# The GPU variants print why and exit 77 (Skipped) without the GPUs or NCCL.
if(TARGET deferalloc_distributed)
  add_executable(test_distributed test_distributed.cpp)
  target_link_libraries(test_distributed PRIVATE deferalloc::distributed GTest::gtest Threads::Threads)
  target_include_directories(test_distributed PRIVATE ${PROJECT_SOURCE_DIR}/allocator ${CMAKE_CURRENT_SOURCE_DIR})
  add_test(NAME test_distributed.host COMMAND test_distributed)
  set_tests_properties(test_distributed.host PROPERTIES ENVIRONMENT "DFA_TEST_DRIVER=host" TIMEOUT 900)
  add_test(NAME test_distributed.cuda COMMAND test_distributed)
  set_tests_properties(test_distributed.cuda PROPERTIES ENVIRONMENT "DFA_TEST_DRIVER=cuda;DFA_TEST_WORLD=1;NCCL_NVLS_ENABLE=0"
                       LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 900)
  add_test(NAME test_distributed.nccl2 COMMAND test_distributed)
  set_tests_properties(test_distributed.nccl2 PROPERTIES ENVIRONMENT "DFA_TEST_DRIVER=cuda;DFA_TEST_WORLD=2;NCCL_NVLS_ENABLE=0"
                       LABELS multigpu SKIP_RETURN_CODE 77 TIMEOUT 900)
endif()
