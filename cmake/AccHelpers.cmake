include(GNUInstallDirs)

# acc_add_library(<layer> SOURCES ... [PUBLIC ...] [PRIVATE ...])
# One static library per layer, named acc_<layer> with the alias acc::<layer>. Public headers live
# in include/acc/<layer>/; the PUBLIC/PRIVATE link lists are where the layering in DESIGN.md is
# enforced by the build.
# Every layer is also installed and exported as AutoAcc::<layer> (the export set AutoAccTargets,
# written by the top-level CMakeLists.txt with AutoAccConfig.cmake), so a new layer is in the
# package without being listed anywhere else. Whatever a PUBLIC list names, and the targets of a
# PRIVATE list too (a static library's private dependencies are linked by its users),
# cmake/AutoAccConfig.cmake.in must find.
function(acc_add_library layer)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC;PRIVATE" ${ARGN})
  add_library(acc_${layer} STATIC ${ARG_SOURCES})
  add_library(acc::${layer} ALIAS acc_${layer})
  target_include_directories(acc_${layer}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
           $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(acc_${layer} PUBLIC ${ARG_PUBLIC} PRIVATE ${ARG_PRIVATE})
  # The API is C++20 (options are passed as AdamW::Options{.lr = 3e-4}): a user's project gets
  # the standard from the target, as it does not see our CMAKE_CXX_STANDARD.
  target_compile_features(acc_${layer} PUBLIC cxx_std_20)
  if(ACC_BUILD_FUZZERS AND layer IN_LIST ACC_FUZZED_LIBRARIES)
    target_compile_options(acc_${layer} PRIVATE -O1)
  endif()
  acc_install_library(acc_${layer} ${layer})
endfunction()

# The options of a test binary's own sources. -O1: a test's code checks and drives the libraries
# (compiled with the build's -O3), and compiles 20-30 % faster than at -O3 (pipeline_test.cpp
# 10.9 s against 13.3 s, tensor_test.cpp 5.0 s against 6.7 s on the 2-vCPU VM). Precompiled
# headers were tried beside it and not kept: GoogleTest, gMock, nlohmann-json and the tensor
# headers precompiled saved nothing measurable (10.6 s), and only a header that also held the
# strategies' and models' headers (a 300 MB .gch loaded by every test) saved more.
function(acc_test_compile_options target)
  target_compile_definitions(${target} PRIVATE
    ACC_TEST_DATA_DIR="${PROJECT_SOURCE_DIR}/tests/data"
    ACC_GOLDEN_DIR="${PROJECT_SOURCE_DIR}/tests/golden")
  if(CMAKE_BUILD_TYPE STREQUAL "Release")
    target_compile_options(${target} PRIVATE -O1)
  endif()
endfunction()

# acc_install_library(<target> <export name>)
# Installs a library into lib/ and adds it to the export set as AutoAcc::<export name>. The global
# property ACC_INSTALLED_LIBRARIES lists them (tests/package requires their files before it runs).
function(acc_install_library target export_name)
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${export_name})
  set_property(GLOBAL APPEND PROPERTY ACC_INSTALLED_LIBRARIES ${target})
  install(TARGETS ${target} EXPORT AutoAccTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endfunction()

# acc_add_test(<name> SOURCES ... [LIBS ...] [MPI_RANKS n ...] [LABELS ...])
# One GoogleTest binary. Without MPI_RANKS it runs as a plain CTest test; with MPI_RANKS it is run
# once per rank count under mpirun (oversubscribed, as root allowed), one thread per rank so that
# ranks x threads never exceeds the cores. A binary whose every test skipped exits 77
# (tests/skip_exit.hpp, in both shared mains), which CTest reports as Skipped, not Passed.
function(acc_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;LIBS;MPI_RANKS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gmock)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  acc_test_compile_options(${name})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  if(ARG_MPI_RANKS)
    foreach(np IN LISTS ARG_MPI_RANKS)
      add_test(NAME ${name}_np${np}
        COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe
                --bind-to none -x OMP_NUM_THREADS=1 -x OPENBLAS_NUM_THREADS=1 -x ACC_NUM_THREADS=1
                $<TARGET_FILE:${name}>)
      set_tests_properties(${name}_np${np} PROPERTIES TIMEOUT ${ARG_TIMEOUT}
        LABELS "mpi;${ARG_LABELS}" PROCESSORS ${np} SKIP_RETURN_CODE 77
        ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
    endforeach()
  else()
    add_test(NAME ${name} COMMAND ${name})
    set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${ARG_LABELS}"
      SKIP_RETURN_CODE 77
      ENVIRONMENT "OPENBLAS_NUM_THREADS=1;ACC_NUM_THREADS=1")
  endif()
endfunction()
