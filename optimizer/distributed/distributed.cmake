# deferalloc::distributed — the ZeRO-1 distributed optimizer over NCCL.
# Built only when nccl.h is found: the CUDA toolkit's include dir, $NCCL_HOME, or the
# nvidia-nccl-cu13 wheel of python3 (DEFERALLOC_PYTHON).  libnccl.so.2 is opened at run
# time (optimizer/distributed/nccl_communicator.cpp); the directory found here is its last fallback.
set(dfa_nccl_hints /usr/local/cuda $ENV{NCCL_HOME} $ENV{CUDA_HOME})
foreach(py IN ITEMS "${DEFERALLOC_PYTHON}" python3)
  if(py)
    execute_process(COMMAND ${py} -c "import nvidia.nccl as n; print(list(n.__path__)[0])"
                    OUTPUT_VARIABLE dfa_nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(dfa_nccl_wheel)
      list(APPEND dfa_nccl_hints ${dfa_nccl_wheel})
    endif()
  endif()
endforeach()
find_path(DFA_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} PATHS ${dfa_nccl_hints} PATH_SUFFIXES include)
find_library(DFA_NCCL_LIBRARY NAMES nccl libnccl.so.2 PATHS ${dfa_nccl_hints} PATH_SUFFIXES lib lib64)
if(DFA_NCCL_INCLUDE_DIR AND TARGET CUDA::toolkit)  # nccl.h includes cuda_runtime.h
  set(DEFERALLOC_HAVE_NCCL ON CACHE INTERNAL "")
  message(STATUS "deferalloc: NCCL headers in ${DFA_NCCL_INCLUDE_DIR}, library ${DFA_NCCL_LIBRARY} (opened at run time)")
  add_library(deferalloc_distributed SHARED distributed/distributed_adamw.cpp distributed/nccl_communicator.cpp)
  add_library(deferalloc::distributed ALIAS deferalloc_distributed)
  target_link_libraries(deferalloc_distributed PUBLIC deferalloc::optimizer PRIVATE CUDA::toolkit ${CMAKE_DL_LIBS})
  target_include_directories(deferalloc_distributed PRIVATE ${DFA_NCCL_INCLUDE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(deferalloc_distributed PRIVATE $<BUILD_INTERFACE:deferalloc_log>)
  if(DFA_NCCL_LIBRARY)
    get_filename_component(dfa_nccl_dir ${DFA_NCCL_LIBRARY} DIRECTORY)
    target_compile_definitions(deferalloc_distributed PRIVATE DFA_NCCL_LIB_DIR="${dfa_nccl_dir}")
  endif()
  target_compile_options(deferalloc_distributed PRIVATE -Wall -Wextra)
  set_target_properties(deferalloc_distributed PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR})
  install(TARGETS deferalloc_distributed EXPORT deferalloc-targets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
else()
  set(DEFERALLOC_HAVE_NCCL OFF CACHE INTERNAL "")
  message(STATUS "deferalloc: nccl.h or the CUDA toolkit not found: the distributed optimizer is not built")
endif()
