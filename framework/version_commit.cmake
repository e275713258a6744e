# Writes OUT, a header defining CARRY_GIT_COMMIT for framework/version.cpp: the short hash of the commit
# checked out in SOURCE_DIR, with "-dirty" after it when tracked files differ from that commit, or
# "unknown" when SOURCE_DIR is not the top of a git work tree (a source archive, or a copy inside
# another repository) or git is missing. CMakeLists.txt runs it at every build (target carry_commit);
# OUT is rewritten only when its text changes, so a new commit recompiles framework/version.cpp only.
#
#   cmake -DSOURCE_DIR=<repository root> -DOUT=<header> -P framework/version_commit.cmake
if(NOT SOURCE_DIR OR NOT OUT)
  message(FATAL_ERROR "version_commit.cmake: SOURCE_DIR and OUT are required")
endif()

set(commit "unknown")
find_program(CARRY_GIT git)
if(CARRY_GIT)
  execute_process(COMMAND ${CARRY_GIT} -C ${SOURCE_DIR} rev-parse --show-toplevel
                  OUTPUT_VARIABLE top RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(rc EQUAL 0)
    file(REAL_PATH "${top}" top)
    file(REAL_PATH "${SOURCE_DIR}" source)
  endif()
  if(rc EQUAL 0 AND top STREQUAL source)
    execute_process(COMMAND ${CARRY_GIT} -C ${SOURCE_DIR} rev-parse --short HEAD
                    OUTPUT_VARIABLE hash RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(rc EQUAL 0 AND hash MATCHES "^[0-9a-f]+$")
      set(commit "${hash}")
      # Tracked files only: build outputs and other untracked files do not make a tree dirty.
      execute_process(COMMAND ${CARRY_GIT} -C ${SOURCE_DIR} status --porcelain --untracked-files=no
                      OUTPUT_VARIABLE changes RESULT_VARIABLE rc ERROR_QUIET)
      if(NOT rc EQUAL 0 OR NOT changes STREQUAL "")
        string(APPEND commit "-dirty")
      endif()
    endif()
  endif()
endif()

set(text "// Written by framework/version_commit.cmake at build time.\n#define CARRY_GIT_COMMIT \"${commit}\"\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
else()
  set(old "")
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
