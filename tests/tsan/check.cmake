# Configures and builds tests/tsan (ThreadSanitizer) in WORK_DIR, then runs both stress
# tests on the host driver until their floors are reached and at least DFA_STRESS_SECONDS
# (default 3) have passed, each capped at DFA_STRESS_CAP_SECONDS (default here 200, under
# the ctest timeout); any ThreadSanitizer report fails the run (halt_on_error).
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR} -G ${GENERATOR}
                -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=${CXX_COMPILER} COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR} -j2 COMMAND_ERROR_IS_FATAL ANY)
if(NOT DEFINED ENV{DFA_STRESS_SECONDS})
  set(ENV{DFA_STRESS_SECONDS} 3)
endif()
if(NOT DEFINED ENV{DFA_STRESS_CAP_SECONDS})
  set(ENV{DFA_STRESS_CAP_SECONDS} 200)
endif()
set(ENV{DFA_TEST_DRIVER} host)
set(ENV{TSAN_OPTIONS} "halt_on_error=1 second_deadlock_stack=1")
execute_process(COMMAND ${WORK_DIR}/stress_tsan COMMAND_ERROR_IS_FATAL ANY)
set(ENV{DEFERALLOC_CONF} driver:host)
execute_process(COMMAND ${WORK_DIR}/c_api_stress_tsan COMMAND_ERROR_IS_FATAL ANY)
