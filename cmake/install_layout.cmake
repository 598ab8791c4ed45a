# Installed names and run-time search paths of the libraries (included by the top level
# after every library target exists).
#
# Note [Installed names]: the targets are deferalloc_<part> in the build (file names
# libdeferalloc_<part>.so) and deferalloc::<part> for a consumer, both in this build
# (ALIAS) and from an installed tree (EXPORT_NAME): deferalloc::deferalloc,
# deferalloc::optimizer, deferalloc::distributed, deferalloc::torch.  Every library is
# installed into one directory and finds its siblings there ($ORIGIN), which is also
# what the Python wheel relies on (deferalloc/lib inside the package, pyproject.toml).
set(dfa_export_names deferalloc_optimizer optimizer deferalloc_distributed distributed deferalloc_torch torch)
while(dfa_export_names)
  list(POP_FRONT dfa_export_names dfa_target dfa_name)
  if(TARGET ${dfa_target})
    set_target_properties(${dfa_target} PROPERTIES EXPORT_NAME ${dfa_name})
  endif()
endwhile()
# (deferalloc_torch also looks in Torch's lib directory: allocator/CMakeLists.txt.)
foreach(dfa_target deferalloc deferalloc_optimizer deferalloc_distributed deferalloc_preload)
  if(TARGET ${dfa_target})
    set_target_properties(${dfa_target} PROPERTIES INSTALL_RPATH "$ORIGIN")
  endif()
endforeach()
# A wheel holds no symbolic links (pip would copy each library three times): in the
# wheel build the libraries carry no version suffix and find each other as libX.so.
option(DEFERALLOC_PYTHON_WHEEL "Building the Python wheel (pyproject.toml)" OFF)
if(DEFERALLOC_PYTHON_WHEEL)
  foreach(dfa_target deferalloc deferalloc_optimizer deferalloc_distributed deferalloc_torch)
    if(TARGET ${dfa_target})
      set_property(TARGET ${dfa_target} PROPERTY VERSION)
      set_property(TARGET ${dfa_target} PROPERTY SOVERSION)
    endif()
  endforeach()
endif()
