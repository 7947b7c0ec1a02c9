#include "core/tensor.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>

namespace hlm {

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    HLM_CHECK(d >= 0, "negative dimension in shape {}", shape_str(s));
    HLM_CHECK(!__builtin_mul_overflow(n, d, &n), "shape {} has more than 2^63 elements",
              shape_str(s));
  }
  return n;
}

size_t shape_nbytes(const Shape& s, DType dt) {
  const uint64_t n = uint64_t(shape_numel(s));
  uint64_t bytes = 0;
  HLM_CHECK(!__builtin_mul_overflow(n, uint64_t(dtype_size(dt)), &bytes) &&
                bytes <= uint64_t(std::numeric_limits<int64_t>::max()),
            "{} tensor of shape {} needs more than 2^63 bytes", dtype_name(dt), shape_str(s));
  return size_t(bytes);
}

namespace {
Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (int64_t i = int64_t(s.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    HLM_CHECK(!__builtin_mul_overflow(acc, std::max<int64_t>(s[i], 1), &acc),
              "shape {}: the strides exceed 2^63", shape_str(s));
  }
  return st;
}
int64_t wrap_dim(int64_t d, int64_t ndim, const char* op) {
  int64_t w = d < 0 ? d + ndim : d;
  HLM_CHECK(w >= 0 && w < ndim, "{}: dimension {} out of range for a {}-d tensor", op, d, ndim);
  return w;
}
// Visit every element offset (in elements, relative to the storage start) of a strided view in
// row-major order.
template <class F>
void for_each_offset(const Shape& shape, const Shape& strides, int64_t offset, F&& f) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  const int64_t nd = int64_t(shape.size());
  std::vector<int64_t> idx(nd, 0);
  int64_t off = offset;
  for (int64_t i = 0; i < n; ++i) {
    f(i, off);
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        off += strides[d];
        break;
      }
      off -= strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}
}  // namespace

Storage::Storage(Device d, size_t n) : ptr(device_alloc(d, n)), nbytes(n), device(d) {}
Storage::~Storage() {
  device_free(device, ptr);
}

Tensor Tensor::empty(const Shape& shape, DType dt, Device dev) {
  Tensor t;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dt;
  t.storage_ = std::make_shared<Storage>(dev, shape_nbytes(shape, dt));
  return t;
}

Tensor Tensor::wrap(std::shared_ptr<Storage> storage, size_t byte_offset, const Shape& shape,
                    DType dt) {
  HLM_CHECK(storage != nullptr, "wrap: no storage");
  const size_t es = dtype_size(dt);
  HLM_CHECK(byte_offset % es == 0, "wrap: byte offset {} is not a multiple of the {}-byte element",
            byte_offset, es);
  const size_t nb = shape_nbytes(shape, dt);
  HLM_CHECK(byte_offset <= storage->nbytes && nb <= storage->nbytes - byte_offset,
            "wrap: {} {} at byte {} exceeds the storage of {} bytes", dtype_name(dt),
            shape_str(shape), byte_offset, storage->nbytes);
  Tensor t;
  t.storage_ = std::move(storage);
  t.offset_ = int64_t(byte_offset / es);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dt;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dt, Device dev) {
  Tensor t = empty(shape, dt, dev);
  t.zero_();
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dt, Device dev) {
  Tensor t = empty(shape, dt, Device::cpu);
  t.fill_(value);
  return dev == Device::cpu ? t : t.to(dev);
}

Tensor Tensor::from_values(const Shape& shape, const std::vector<double>& v, DType dt) {
  HLM_CHECK(int64_t(v.size()) == shape_numel(shape), "from_values: {} values for shape {}",
            v.size(), shape_str(shape));
  Tensor t = empty(shape, dt);
  convert_elements(v.data(), DType::f64, t.raw(), dt, v.size());
  return t;
}

int64_t Tensor::size(int64_t d) const {
  return shape_[wrap_dim(d, dim(), "size")];
}
int64_t Tensor::stride(int64_t d) const {
  return strides_[wrap_dim(d, dim(), "stride")];
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // nothing to lay out
  int64_t acc = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != acc) return false;
    acc *= shape_[i];
  }
  return true;
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined";
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " " + device_name(device());
}

void* Tensor::raw() const {
  HLM_CHECK(defined(), "access to an undefined tensor");
  return static_cast<char*>(storage_->ptr) + offset_ * int64_t(dtype_size(dtype_));
}

Tensor Tensor::view(const Shape& shape) const {
  HLM_CHECK(is_contiguous(), "view of a non-contiguous tensor {}", describe());
  Shape s = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      HLM_CHECK(infer < 0, "view: more than one -1 in {}", shape_str(shape));
      infer = int64_t(i);
    } else {
      HLM_CHECK(s[i] >= 0, "view: bad dimension in {}", shape_str(shape));
      known *= s[i];
    }
  }
  if (infer >= 0) {
    HLM_CHECK(known > 0 && numel() % known == 0, "view: cannot view {} as {}", describe(),
              shape_str(shape));
    s[infer] = numel() / known;
  }
  HLM_CHECK(shape_numel(s) == numel(), "view: cannot view {} as {}", describe(), shape_str(shape));
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  return is_contiguous() ? view(shape) : contiguous().view(shape);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end) const {
  d = wrap_dim(d, dim(), "slice");
  HLM_CHECK(0 <= start && start <= end && end <= shape_[d],
            "slice: range [{}, {}) out of bounds for dimension {} of {}", start, end, d,
            describe());
  Tensor t = *this;
  t.offset_ += start * strides_[d];
  t.shape_[d] = end - start;
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d, dim(), "select");
  HLM_CHECK(0 <= index && index < shape_[d],
            "select: index {} out of bounds for dimension {} of {}", index, d, describe());
  Tensor t = *this;
  t.offset_ += index * strides_[d];
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::bitcast(DType dt) const {
  HLM_CHECK(dtype_size(dt) == dtype_size(dtype_), "bitcast: {} has {}-byte elements, {} has {}",
            describe(), dtype_size(dtype_), dtype_name(dt), dtype_size(dt));
  Tensor t = *this;
  t.dtype_ = dt;
  return t;
}

Tensor Tensor::transpose(int64_t a, int64_t b) const {
  a = wrap_dim(a, dim(), "transpose");
  b = wrap_dim(b, dim(), "transpose");
  Tensor t = *this;
  std::swap(t.shape_[a], t.shape_[b]);
  std::swap(t.strides_[a], t.strides_[b]);
  return t;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Tensor t = *this;
  const int64_t st = d < dim() ? strides_[d] * shape_[d] : 1;
  t.shape_.insert(t.shape_.begin() + d, 1);
  t.strides_.insert(t.strides_.begin() + d, st);
  return t;
}

Tensor Tensor::split_dim(int64_t d, int64_t inner) const {
  d = wrap_dim(d, dim(), "split_dim");
  HLM_CHECK(inner >= 1 && shape_[d] % inner == 0,
            "split_dim: dimension {} of {} is not a multiple of {}", d, describe(), inner);
  Tensor t = *this;
  t.shape_[d] = shape_[d] / inner;
  t.shape_.insert(t.shape_.begin() + d + 1, inner);
  t.strides_[d] = strides_[d] * inner;
  t.strides_.insert(t.strides_.begin() + d + 1, strides_[d]);
  return t;
}

Tensor Tensor::as_strided(const Shape& shape, const Shape& strides, int64_t offset) const {
  HLM_CHECK(defined(), "as_strided: undefined tensor");
  HLM_CHECK(shape.size() == strides.size(), "as_strided: {} sizes and {} strides", shape.size(),
            strides.size());
  int64_t last = offset_ + offset;  // the last element spanned (or the first when empty)
  bool empty = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    HLM_CHECK(shape[i] >= 0 && strides[i] >= 0, "as_strided: negative size or stride in {} / {}",
              shape_str(shape), shape_str(strides));
    if (shape[i] == 0)
      empty = true;
    else
      last += (shape[i] - 1) * strides[i];
  }
  const int64_t elems = int64_t(storage_->nbytes / dtype_size(dtype_));
  HLM_CHECK(offset_ + offset >= 0 && (empty || last < elems),
            "as_strided: {} with strides {} from element {} leaves the storage of {} elements",
            shape_str(shape), shape_str(strides), offset_ + offset, elems);
  Tensor t = *this;
  t.shape_ = shape;
  t.strides_ = strides;
  t.offset_ += offset;
  return t;
}

Tensor Tensor::contiguous() const {
  return is_contiguous() ? *this : clone();
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(DType dt) const {
  if (dt == dtype_) return clone();
  Tensor t = empty(shape_, dt, device());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(Device dev) const {
  Tensor t = empty(shape_, dtype_, dev);
  t.copy_(*this);
  return t;
}

void Tensor::copy_(const Tensor& src) {
  HLM_CHECK(defined() && src.defined(), "copy_ with an undefined tensor");
  HLM_CHECK(shape_ == src.shape_, "copy_: shape {} into {}", shape_str(src.shape_),
            shape_str(shape_));
  const Device dd = device(), sd = src.device();
  if (dd == Device::cpu && sd == Device::cpu) {
    if (is_contiguous() && src.is_contiguous()) {
      convert_elements(src.raw(), src.dtype_, raw(), dtype_, size_t(numel()));
      return;
    }
    const size_t ses = src.element_size(), des = element_size();
    const char* sbase = static_cast<const char*>(src.storage_->ptr);
    char* dbase = static_cast<char*>(storage_->ptr);
    std::vector<int64_t> soffs(static_cast<size_t>(numel()));
    for_each_offset(src.shape_, src.strides_, src.offset_,
                    [&](int64_t i, int64_t off) { soffs[size_t(i)] = off; });
    for_each_offset(shape_, strides_, offset_, [&](int64_t i, int64_t off) {
      convert_elements(sbase + soffs[size_t(i)] * int64_t(ses), src.dtype_,
                       dbase + off * int64_t(des), dtype_, 1);
    });
    return;
  }
  // Across devices: stage through contiguous buffers of the same dtype.
  HLM_CHECK(dtype_ == src.dtype_ || sd == Device::cpu,
            "copy_ from a {} tensor to {}: convert on the CPU first", src.describe(), describe());
  if (sd != Device::cpu && !src.is_contiguous()) {
    // A strided view on the device: its storage to the host, the same view there, then a copy from
    // that CPU view.
    Tensor host = src;
    host.storage_ = std::make_shared<Storage>(Device::cpu, src.storage_->nbytes);
    device_copy(host.storage_->ptr, Device::cpu, src.storage_->ptr, sd, src.storage_->nbytes);
    copy_(host);
    return;
  }
  Tensor s = src.contiguous();
  if (s.dtype_ != dtype_) s = s.to(dtype_);  // CPU conversion
  if (is_contiguous()) {
    device_copy(raw(), dd, s.raw(), s.device(), nbytes());
  } else {
    HLM_CHECK(dd == Device::cpu, "copy_ into a non-contiguous CUDA tensor is not supported");
    Tensor staged = s.to(Device::cpu);
    copy_(staged);
  }
}

void Tensor::fill_(double v) {
  HLM_CHECK(defined(), "fill_ of an undefined tensor");
  if (device() != Device::cpu) {
    Tensor c = Tensor::full(shape_, v, dtype_, Device::cpu);
    copy_(c);
    return;
  }
  // Convert once, then replicate the bytes.
  alignas(8) unsigned char one[8];
  convert_elements(&v, DType::f64, one, dtype_, 1);
  const size_t es = element_size();
  char* base = static_cast<char*>(storage_->ptr);
  for_each_offset(shape_, strides_, offset_,
                  [&](int64_t, int64_t off) { std::memcpy(base + off * int64_t(es), one, es); });
}

void Tensor::zero_() {
  if (is_contiguous()) {
    device_memset_zero(device(), raw(), nbytes());
  } else {
    fill_(0.0);
  }
}

std::vector<double> Tensor::to_f64_vector() const {
  HLM_CHECK(defined(), "to_f64_vector of an undefined tensor");
  Tensor c = is_cpu() ? contiguous() : to(Device::cpu);
  std::vector<double> out(size_t(c.numel()));
  convert_elements(c.raw(), c.dtype_, out.data(), DType::f64, out.size());
  return out;
}

std::vector<int64_t> Tensor::to_i64_vector() const {
  HLM_CHECK(defined() && (dtype_ == DType::i64 || dtype_ == DType::i32),
            "to_i64_vector needs an i64 or i32 tensor, got {}", defined() ? describe() : "none");
  const Tensor c = is_cpu() ? contiguous() : to(Device::cpu);
  if (dtype_ == DType::i64)
    return std::vector<int64_t>(c.data<int64_t>(), c.data<int64_t>() + c.numel());
  return std::vector<int64_t>(c.data<int32_t>(), c.data<int32_t>() + c.numel());
}

double Tensor::item() const {
  HLM_CHECK(numel() == 1, "item() of a tensor with {} elements", numel());
  return to_f64_vector()[0];
}

double Tensor::at(std::initializer_list<int64_t> idx) const {
  HLM_CHECK(int64_t(idx.size()) == dim(), "at(): {} indices for a {}-d tensor", idx.size(), dim());
  Tensor t = *this;
  int64_t d = 0;
  for (int64_t i : idx) t = t.select(0, i), ++d;
  return t.item();
}

void check_defined(const Tensor& t, const char* what) {
  HLM_CHECK(t.defined(), "{}: tensor is missing", what);
}
void check_shape(const Tensor& t, const Shape& expected, const char* what) {
  check_defined(t, what);
  HLM_CHECK(t.shape() == expected, "{}: expected shape {}, got {}", what, shape_str(expected),
            shape_str(t.shape()));
}
void check_dim(const Tensor& t, int64_t ndim, const char* what) {
  check_defined(t, what);
  HLM_CHECK(t.dim() == ndim, "{}: expected a {}-d tensor, got shape {}", what, ndim,
            shape_str(t.shape()));
}
void check_dtype(const Tensor& t, DType dt, const char* what) {
  check_defined(t, what);
  HLM_CHECK(t.dtype() == dt, "{}: expected dtype {}, got {}", what, dtype_name(dt),
            dtype_name(t.dtype()));
}
void check_device(const Tensor& t, Device dev, const char* what) {
  check_defined(t, what);
  HLM_CHECK(t.device() == dev, "{}: expected a {} tensor, got {}", what, device_name(dev),
            device_name(t.device()));
}

}  // namespace hlm
